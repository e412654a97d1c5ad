"""Hosts that are not loopback, on one machine, and pdserve started on them: a Linux
bridge and one network namespace per host, each with its own address on a private subnet,
and the services bound to those addresses with a multi-host deployment's credentials.
Shared by the network-namespace tests (tests/netns) and the benchmarks that run on the
same hosts (benchmarks/network_cost.py, benchmarks/chaos.py --net).

    fabric = Fabric.create(["redis", "router", "prefill", "decode"])
    fabric.addr("decode")                        # e.g. "10.77.12.5"
    proc = fabric.popen("decode", [...], log)    # runs in that host's namespace
    fabric.shape("decode", delay_ms=1, rate_mbit=1000)
    fabric.cut("decode"); ...; fabric.restore("decode")
    fabric.cut_between("prefill", "decode"); ...; fabric.restore_between(...)
    fabric.lose("decode", 0.05); ...; fabric.unlose("decode")
    fabric.delay("decode", 100); ...; fabric.undelay("decode")
    fabric.close()

Each host also gets its own UTS namespace (hostname): pdserve treats two workers with one
hostname as one machine and moves their KV through shared memory, which would bypass the
links under test. The machine running the tests reaches every host through the bridge,
whose address is the subnet's `.1` (it plays the clients' machine).

Everything is named after the creating process's id (`pdn<pid>...`), so concurrent runs
never collide and a run killed before its teardown is recognised and removed by the next
one (`sweep_stale`). Needs root, `ip` (iproute2), `tc`, `unshare`, `ss`, and iptables for
cuts between two hosts and for loss. Link delay needs the kernel's netem qdisc; where the
kernel lacks it, `shape` limits the rate (tbf) and reports that no delay was added, and
`delay` holds each packet a host receives in a userspace queue (NFQUEUE; see
services/bench/netdelay.py) instead.

pdserve itself is started on the hosts by services/bench/netns_stack.py.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "pdn"  # every namespace and link this harness makes starts with it
_OWNED = re.compile(rf"^{PREFIX}(\d+)")
SUBNET_BASE = "10.77"  # hosts get 10.77.<n>.0/24, n chosen per run
# `ip netns exec NS` bind-mounts the files of /etc/netns/NS over /etc: each host's
# /etc/hosts names every host, and its resolv.conf names no server, so a name lookup
# (vLLM and Python's socket.getfqdn make some) answers at once instead of waiting out the
# timeouts of a DNS server the namespace cannot reach.
ETC_NETNS = Path("/etc/netns")


class FabricError(RuntimeError):
    """A namespace, link or qdisc could not be made or changed; says what failed."""


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise FabricError(f"`{' '.join(cmd)}` failed ({proc.returncode}): "
                          f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare", "ss"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install iproute2 util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    # "12: pdn123v0@if11: <...>" -> "pdn123v0"
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
            if line.count(":") >= 2]


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL what still runs in `ns` (processes a harness started there, by pid)."""
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _remove(namespaces: list[str], links: list[str]) -> None:
    for ns in namespaces:
        _kill_namespace_processes(ns)
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    for link in links:  # veth peers vanish with their namespace; the bridge stays
        _run(["ip", "link", "del", link], check=False)


def sweep_stale() -> list[str]:
    """Remove namespaces and links of runs whose process is gone (a run killed before its
    teardown); returns their names."""
    def stale(name: str) -> bool:
        m = _OWNED.match(name)
        return m is not None and not _alive(int(m.group(1)))

    namespaces = [ns for ns in _namespaces() if stale(ns)]
    if ETC_NETNS.is_dir():
        namespaces += [p.name for p in ETC_NETNS.iterdir()
                       if stale(p.name) and p.name not in namespaces]
    links = [link for link in _links() if stale(link)]
    _remove(namespaces, links)
    return namespaces + links


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 under SUBNET_BASE that no interface of this machine is on."""
    used = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    start = os.getpid() % 250
    for i in range(250):
        n = (start + i) % 250 + 1
        if f" {SUBNET_BASE}.{n}." not in used:
            return ipaddress.IPv4Network(f"{SUBNET_BASE}.{n}.0/24")
    raise FabricError(f"every {SUBNET_BASE}.x.0/24 subnet is in use on this machine")


_HOLDER = re.compile(r'users:\(\("([^"]*)",pid=(\d+)')


@dataclass(frozen=True)
class Socket:
    ip: str  # "*" or "0.0.0.0" or "::" for every interface
    port: int
    process: str  # the holder's name (vLLM names its processes: VLLM::Worker, ...)
    pid: int

    def __str__(self) -> str:
        return f"{self.ip}:{self.port} ({self.process}, pid {self.pid})"


@dataclass
class Host:
    name: str
    ns: str
    addr: str
    veth: str  # the bridge-side end; the namespace's end is `eth0`


@dataclass
class Fabric:
    """A bridge and one namespace per host (see the module's docstring)."""

    subnet: ipaddress.IPv4Network
    bridge: str
    hosts: dict[str, Host] = field(default_factory=dict)
    netem: bool | None = None  # does this kernel have netem (known after the first shape)
    _cuts: set[tuple[str, str]] = field(default_factory=set)
    _lossy: dict[str, float] = field(default_factory=dict)  # host -> share of packets dropped
    _delayers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @classmethod
    def create(cls, names: list[str]) -> Fabric:
        sweep_stale()
        tag = f"{PREFIX}{os.getpid()}"
        subnet = _free_subnet()
        fabric = cls(subnet, f"{tag}br")
        try:
            gateway = f"{subnet.network_address + 1}"
            _run(["ip", "link", "add", fabric.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", fabric.bridge])
            _run(["ip", "link", "set", fabric.bridge, "up"])
            for i, name in enumerate(names):
                fabric._add_host(name, f"{tag}-{name}", f"{tag}v{i}",
                                 f"{subnet.network_address + 2 + i}", gateway)
            fabric._write_etc()
        except BaseException:
            fabric.close()
            raise
        return fabric

    def _add_host(self, name: str, ns: str, veth: str, addr: str, gateway: str) -> None:
        peer = f"{veth}p"
        _run(["ip", "netns", "add", ns])
        self.hosts[name] = Host(name, ns, addr, veth)
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
        _run(["ip", "link", "set", peer, "netns", ns])
        _run(["ip", "link", "set", veth, "master", self.bridge])
        _run(["ip", "link", "set", veth, "up"])
        inside = ["ip", "netns", "exec", ns]
        _run([*inside, "ip", "link", "set", peer, "name", "eth0"])
        _run([*inside, "ip", "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", "eth0"])
        _run([*inside, "ip", "link", "set", "eth0", "up"])
        # Loopback is each host's own (vLLM's engine talks to its core process over it).
        _run([*inside, "ip", "link", "set", "lo", "up"])
        _run([*inside, "ip", "route", "add", "default", "via", gateway])

    def _write_etc(self) -> None:
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{h.addr} {h.name}\n" for h in self.hosts.values())
        for h in self.hosts.values():
            etc = ETC_NETNS / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / "resolv.conf").write_text("# no DNS server: names are in /etc/hosts\n")

    # -- running things in a host -------------------------------------------------------
    def addr(self, name: str) -> str:
        return self.hosts[name].addr

    def prefix(self, name: str) -> list[str]:
        """The command prefix that runs what follows in `name`'s network namespace, with
        its own hostname (`name`)."""
        host = self.hosts[name]
        return ["ip", "netns", "exec", host.ns, "unshare", "--uts", "sh", "-c",
                f'echo {name} > /proc/sys/kernel/hostname && exec "$@"', "sh"]

    def run(self, name: str, cmd: list[str], check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        return _run(["ip", "netns", "exec", self.hosts[name].ns, *cmd], check=check)

    def popen(self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        """`cmd` in `name`'s namespace, in a session of its own (stop it with
        `stop_group`), its output in `log`. Every exec in the prefix replaces its
        process, so the pid returned is the command's own."""
        with log.open("ab") as out:
            return subprocess.Popen([*self.prefix(name), *cmd], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **(env or {})})

    def listeners(self, name: str) -> list[str]:
        """Local addresses of the TCP sockets listening in `name` (`ip:port`)."""
        return [f"{s.ip}:{s.port}" for s in self.sockets(name)]

    def sockets(self, name: str) -> list[Socket]:
        """The TCP sockets listening in `name`, with the process holding each."""
        out = self.run(name, ["ss", "-H", "-l", "-t", "-n", "-p"]).stdout
        found = []
        for line in out.splitlines():
            if not line.strip():
                continue
            local = line.split()[3]
            ip, _, port = local.rpartition(":")
            # gRPC binds an IPv4 address as its IPv6-mapped form: [::ffff:10.77.x.y]:port.
            ip = ip.strip("[]").removeprefix("::ffff:")
            holder = _HOLDER.search(line)
            found.append(Socket(ip, int(port), holder.group(1) if holder else "",
                                int(holder.group(2)) if holder else 0))
        return found

    def link_bytes(self, name: str) -> tuple[int, int]:
        """Bytes `name` has sent and received over its link so far (its bridge port's
        counters, read from outside: they keep counting whatever runs in the host)."""
        stats = Path("/sys/class/net") / self.hosts[name].veth / "statistics"
        # The bridge-side end receives what the host sends, and sends what it receives.
        return (int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))

    # -- links ----------------------------------------------------------------------------
    def shape(self, name: str, delay_ms: float, rate_mbit: int) -> bool:
        """Both directions of `name`'s link: `delay_ms` each way and at most `rate_mbit`.
        True when the delay was applied; False where the kernel has no netem, in which
        case only the rate is limited (tbf)."""
        host = self.hosts[name]
        ends = [(["ip", "netns", "exec", host.ns], "eth0"), ([], host.veth)]
        if self.netem is not False:
            probe = _run([*ends[0][0], "tc", "qdisc", "replace", "dev", "eth0", "root",
                          "netem", "delay", f"{delay_ms}ms", "rate", f"{rate_mbit}mbit"],
                         check=False)
            self.netem = probe.returncode == 0
            if not self.netem and "unknown" not in probe.stderr.lower():
                raise FabricError(f"tc netem on {name}: {probe.stderr.strip()}")
        for prefix, dev in ends:
            if self.netem:
                qdisc = ["netem", "delay", f"{delay_ms}ms", "rate", f"{rate_mbit}mbit"]
            else:
                # A bucket of 4 ms at the rate (and never under 64 KiB, or a full-size
                # segment could not pass); a queue of at most 100 ms before drops.
                burst = max(64 << 10, rate_mbit * 1_000_000 // 8 // 250)
                qdisc = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
                         "latency", "100ms"]
            _run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc])
        return bool(self.netem)

    def qdiscs(self, name: str) -> str:
        """`tc qdisc show` of both ends of `name`'s link."""
        host = self.hosts[name]
        inside = self.run(name, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        outside = _run(["tc", "qdisc", "show", "dev", host.veth]).stdout
        return inside + outside

    def cut(self, name: str) -> None:
        """Partition `name` from every other host: its bridge port goes down, so packets
        are dropped both ways and nothing tells either side (no reset, no unreachable)."""
        _run(["ip", "link", "set", self.hosts[name].veth, "down"])

    def restore(self, name: str) -> None:
        _run(["ip", "link", "set", self.hosts[name].veth, "up"])

    def cut_between(self, a: str, b: str) -> None:
        """Drop every packet between `a` and `b` only (iptables in `a`'s namespace, both
        directions); each keeps reaching the other hosts."""
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            self.run(a, ["iptables", "-I", chain, flag, self.addr(b), "-j", "DROP"])
        self._cuts.add((a, b))

    def restore_between(self, a: str, b: str) -> None:
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            self.run(a, ["iptables", "-D", chain, flag, self.addr(b), "-j", "DROP"],
                     check=False)
        self._cuts.discard((a, b))

    def lose(self, name: str, share: float) -> None:
        """Drop `share` of the packets `name` receives from its link, each at random
        (iptables' statistic match in its namespace): a loss burst on every path into
        the host. Dropping on receipt only, and in every host, makes each packet between
        two hosts face the loss once."""
        if not 0.0 < share < 1.0:
            raise ValueError(f"a loss share is between 0 and 1, not {share}")
        self.unlose(name)
        self.run(name, ["iptables", "-I", "INPUT", "-i", "eth0", "-m", "statistic",
                        "--mode", "random", "--probability", f"{share:.4f}", "-j", "DROP"])
        self._lossy[name] = share

    def unlose(self, name: str) -> None:
        share = self._lossy.pop(name, None)
        if share is not None:
            self.run(name, ["iptables", "-D", "INPUT", "-i", "eth0", "-m", "statistic",
                            "--mode", "random", "--probability", f"{share:.4f}", "-j",
                            "DROP"], check=False)

    def delay(self, name: str, delay_ms: float, log: Path) -> None:
        """Hold every packet `name` receives from its link for `delay_ms` before letting
        it in: netem's delay without netem. A userspace delayer bound to an NFQUEUE queue
        in the host's namespace (services/bench/netdelay.py, its output in `log`) holds
        the packets; iptables queues the host's INPUT to it. Delaying in every host adds
        `delay_ms` to each packet between two of them, `2 * delay_ms` to a round trip.
        Packets to the clients' machine (the bridge's own address) are not delayed."""
        self.undelay(name)
        proc = self.popen(name, [sys.executable, "-m", "services.bench.netdelay",
                                 "--queue", "0", "--delay-ms", f"{delay_ms:g}"], log)
        self._delayers[name] = proc

        def bound() -> bool:
            if proc.poll() is not None:
                raise FabricError(f"the delayer in {name} exited ({proc.returncode}): "
                                  f"{log.read_text(errors='replace').strip()[-500:]}")
            table = self.run(name, ["cat", "/proc/net/netfilter/nfnetlink_queue"],
                             check=False).stdout
            return any(line.split()[:1] == ["0"] for line in table.splitlines())

        wait_for(bound, 15, f"the delayer in {name} bound to its queue", period=0.05)
        self.run(name, ["iptables", "-I", "INPUT", "-i", "eth0", "-j", "NFQUEUE",
                        "--queue-num", "0", "--queue-bypass"])

    def undelay(self, name: str) -> None:
        proc = self._delayers.pop(name, None)
        if proc is None:
            return
        self.run(name, ["iptables", "-D", "INPUT", "-i", "eth0", "-j", "NFQUEUE",
                        "--queue-num", "0", "--queue-bypass"], check=False)
        stop_group(proc, timeout=5)  # SIGTERM: it lets every held packet through first

    def heal(self) -> None:
        """Undo every cut, loss and delay this fabric has made."""
        for a, b in list(self._cuts):
            self.restore_between(a, b)
        for name in list(self._lossy):
            self.unlose(name)
        for name in list(self._delayers):
            self.undelay(name)
        for name in self.hosts:
            self.restore(name)

    def close(self) -> None:
        """Remove every namespace and the bridge, killing what still runs in them."""
        for proc in self._delayers.values():
            stop_group(proc, timeout=5)
        self._delayers.clear()
        _remove([h.ns for h in self.hosts.values()], [self.bridge])
        self.hosts.clear()


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM a process started in its own session, then SIGKILL what is left."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str,
             period: float = 0.2) -> None:
    """Poll `predicate()` until true; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f} s")
        time.sleep(period)

