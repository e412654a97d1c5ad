"""pdserve on the hosts of a network-namespace fabric (services/bench/netns.py).

`NetStack` starts redis-server, prefill and decode workers and a router in a fabric's
hosts, each bound to its own host's address (never 0.0.0.0, never loopback), with the
cluster's credentials as a multi-host deployment has them: a Redis password, a cluster
secret for the records, internal mTLS between router, workers and KV transports, and on
the public API an API key and a TLS certificate issued for the router's address.
`start_pd` starts the prefill/decode stack the tests and benchmarks share, and `NetFaults`
the network faults the chaos benchmark injects between its hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from prometheus_client.parser import text_string_to_metric_families

from services.api.client import PdserveClient
from services.bench.netns import Fabric, stop_group
from services.bench.procstats import scrape
from services.registry.redis_server import write_private
from services.security import certs
from services.security.tls import TLSFiles
from services.server.channels import dial

GRPC_PORT = 50051  # every host has its own ports: one number for all of them
METRICS_PORT = 9400
KV_PORT = 7100
REDIS_PORT = 6379
API_KEY = "netns-tester-0123456789abcdef"


@dataclass
class Service:
    host: str
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.host} exited ({self.proc.returncode}):\n"
                               f"{self.log_tail()}")


@dataclass
class NetStack:
    fabric: Fabric
    workdir: Path
    certs_dir: Path = field(init=False)
    redis_password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    cluster_secret: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    services: dict[str, Service] = field(default_factory=dict)
    _registry: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.certs_dir = self.workdir / "certs"
        # The public server certificate names the router's address, which clients dial.
        certs.init(self.certs_dir, hosts=(self.fabric.addr("router"),))
        self.keys_file = self.workdir / "api-keys"
        write_private(self.keys_file, f"tester:{API_KEY}\n")

    # -- addresses and credentials ------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return (f"redis://:{quote(self.redis_password, safe='')}@"
                f"{self.fabric.addr('redis')}:{REDIS_PORT}/0")

    def target(self, host: str) -> str:
        return f"{self.fabric.addr(host)}:{GRPC_PORT}"

    def internal_tls_flags(self, role: str) -> list[str]:
        files = certs.internal_files(self.certs_dir, role)
        return ["--internal-tls-ca-file", str(files.ca), "--internal-tls-cert-file",
                str(files.cert), "--internal-tls-key-file", str(files.key)]

    def client(self) -> PdserveClient:
        """A public API client of the router, from the machine running the tests."""
        return PdserveClient(self.target("router"), api_key=API_KEY,
                             tls=TLSFiles(ca=certs.public_files(self.certs_dir, "server").ca))

    def metrics(self, host: str, **labels: str) -> dict[str, float]:
        """`host`'s Prometheus samples by name (labels dropped; with `labels`, only
        samples carrying them; first sample wins)."""
        return scrape(METRICS_PORT, self.fabric.addr(host), **labels)

    def labelled(self, host: str, name: str, label: str) -> dict[str, float]:
        """The samples of metric `name` on `host`, by the value of `label`."""
        url = f"http://{self.fabric.addr(host)}:{METRICS_PORT}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {s.labels.get(label, ""): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == name}

    # -- starting -----------------------------------------------------------------------
    def start_redis(self) -> None:
        """redis-server bound to the redis host's address, with a password; its config
        file (which holds the password) is removed once the server has read it."""
        folder = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        conf = folder / "redis.conf"
        write_private(conf, "\n".join([
            f"bind {self.fabric.addr('redis')}", "protected-mode yes", f"port {REDIS_PORT}",
            'save ""', "appendonly no", "daemonize no", "loglevel warning",
            f"dir {tempfile.gettempdir()}", f"requirepass {self.redis_password}"]) + "\n")
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; on Debian: "
                               "apt-get install redis-server")
        log = self.workdir / "redis.log"
        self.services["redis"] = Service("redis", self.fabric.popen(
            "redis", [binary, str(conf)], log), log)
        try:
            self._wait_redis()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _wait_redis(self, timeout: float = 15.0) -> None:
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_timeout=0.5,
                                      socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                self.services["redis"].check_alive()
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server did not answer:\n"
                                       f"{self.services['redis'].log_tail()}")
                time.sleep(0.1)
        finally:
            client.close()

    def _start(self, host: str, command: str, args: list[str]) -> Service:
        addr = self.fabric.addr(host)
        cmd = [sys.executable, "-m", "services.cli", command, "--host", addr,
               "--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT),
               "--redis-url", self.redis_url, *args]
        log = self.workdir / f"{host}.log"
        service = Service(host, self.fabric.popen(
            host, cmd, log, env={"PDSERVE_CLUSTER_SECRET": self.cluster_secret}), log)
        self.services[host] = service
        return service

    def start_worker(self, host: str, role: str, cores: str, *extra: str) -> Service:
        args = ["--worker-id", host, "--cpu-cores", cores, "--kv-cache-gib", "1",
                "--worker-ttl-s", "3", *self.internal_tls_flags(role), *extra]
        if role == "decode":
            args += ["--kv-host", self.fabric.addr(host), "--kv-port", str(KV_PORT)]
        return self._start(host, role, args)

    def start_router(self, *extra: str) -> Service:
        server = certs.public_files(self.certs_dir, "server")
        return self._start("router", "router", [
            "--api-keys-file", str(self.keys_file), "--tls-cert-file", str(server.cert),
            "--tls-key-file", str(server.key), *self.internal_tls_flags("router"), *extra])

    async def wait_ready(self, hosts: list[str], timeout: float = 900.0) -> None:
        """Every host's gRPC health SERVING: workers over internal mTLS (as the router
        reaches them), the router over its public TLS."""
        internal = certs.internal_files(self.certs_dir, "router")

        async def one(host: str) -> None:
            deadline = time.monotonic() + timeout
            client = (self.client() if host == "router" else
                      PdserveClient(channel=dial(self.target(host), internal)))
            async with client:
                while True:
                    self.services[host].check_alive()
                    try:
                        if await client.health(timeout=2.0) == "SERVING":
                            return
                    except Exception:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{host} not ready:\n"
                                           f"{self.services[host].log_tail()}")
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(one(h) for h in hosts))

    def stop(self, host: str) -> None:
        service = self.services.pop(host, None)
        if service is not None:
            stop_group(service.proc)

    def close(self) -> None:
        # The router first (it stops sending), Redis last (the workers deregister there).
        order = sorted(self.services, key=lambda h: (h != "router", h == "redis"))
        for host in order:
            self.stop(host)

    # -- what the chaos benchmark reads -------------------------------------------------
    def registry(self) -> Any:
        from services.registry.registry import Registry
        from services.registry.signing import RecordSigner

        if self._registry is None:
            self._registry = Registry.from_url(
                self.redis_url, signer=RecordSigner(self.cluster_secret.encode()))
        return self._registry

    async def records(self) -> list[Any]:
        """The live worker records (raises while Redis is away)."""
        return list(await self.registry().workers())

    async def redis_ping(self) -> bool:
        try:
            return bool(await self.registry().redis.ping())
        except Exception:
            return False

    def redis_pid(self) -> int | None:
        service = self.services.get("redis")
        return None if service is None or service.proc.poll() is not None else service.proc.pid

    def tree(self) -> list[Any]:
        """Every process of every service (the services' own and their children)."""
        import psutil

        procs = []
        for service in self.services.values():
            try:
                root = psutil.Process(service.proc.pid)
                procs += [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
        return procs

    def leases(self) -> int:
        """Client slots held in Redis (lapsed ones are not counted)."""
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
        try:
            now_ms = int(time.time() * 1000)
            return sum(int(client.zcount(key, now_ms, "+inf"))
                       for key in client.scan_iter(match="pdserve:lease:*"))
        finally:
            client.close()

    def held(self, workers: list[str]) -> dict[str, float | None]:
        """What is still staged, in flight or leased: each worker's staged transfers,
        staged bytes and share of vLLM's KV cache in use, the router's requests in
        flight, and the client slots in Redis."""
        state: dict[str, float | None] = {}
        for host in workers:
            m = self.metrics(host)
            state[f"{host} staged transfers"] = m.get("pdserve_kv_staged_transfers")
            state[f"{host} staged bytes"] = m.get("pdserve_kv_staged_bytes")
            # KV blocks a worker still holds (a prefill worker's for a transfer not taken).
            state[f"{host} KV cache in use"] = m.get("vllm:kv_cache_usage_perc")
        state["router in flight"] = self.metrics("router").get("pdserve_router_inflight")
        state["client leases"] = float(self.leases())
        return state

    async def close_registry(self) -> None:
        registry = self._registry
        if registry is not None:
            self._registry = None
            with contextlib.suppress(Exception):
                await registry.close()


# The stack of the netns tests and the network chaos run: a prefill worker and two decode
# workers (KV over gRPC to one, over torch.distributed to the other), each on a host of
# its own, behind one router.
PD_HOSTS = ["redis", "router", "prefill", "decode-grpc", "decode-torch"]
DECODERS = ("decode-grpc", "decode-torch")
WORKERS = ("prefill", *DECODERS)


async def start_pd(stack: NetStack, kv_lease_s: float, client_lease_s: float,
                   client_max_inflight: int = 8) -> None:
    """Redis, the workers and the router of PD_HOSTS, started and SERVING.
    round_robin: consecutive requests alternate between the two decode workers, so both
    transports carry KV within a few requests."""
    lease = ["--kv-lease-s", str(kv_lease_s)]
    stack.start_redis()
    stack.start_worker("prefill", "prefill", "0", *lease)
    stack.start_worker("decode-grpc", "decode", "1", "--kv-transport", "grpc", *lease)
    stack.start_worker("decode-torch", "decode", "1", "--kv-transport", "torch", *lease)
    stack.start_router("--policy", "round_robin", "--client-max-inflight",
                       str(client_max_inflight), "--client-lease-s", str(client_lease_s))
    await stack.wait_ready(["prefill", *DECODERS, "router"])


# -- network faults ----------------------------------------------------------------------
IN_TRANSFER_BYTES = 2 << 20  # received by a decode host within TRANSFER_WINDOW_S: KV in flight
TRANSFER_WINDOW_S = 0.5


@dataclass
class NetFaults:
    """Network faults on a PD_HOSTS stack, for services/bench/faults.py: each `begin`s
    (choosing its hosts at that moment: the decode host receiving a transfer, the one
    streaming the most) and returns what it cut and how to undo it."""

    fabric: Fabric
    workdir: Path
    decoders: tuple[str, ...] = DECODERS
    find_timeout_s: float = 30.0

    def _received(self) -> dict[str, int]:
        return {h: self.fabric.link_bytes(h)[1] for h in self.decoders}

    def _sent(self) -> dict[str, int]:
        return {h: self.fabric.link_bytes(h)[0] for h in self.decoders}

    async def receiving_kv(self) -> str | None:
        """The decode host receiving KV now: IN_TRANSFER_BYTES within TRANSFER_WINDOW_S on
        its link (nothing else sends a decode host megabytes); None if none within
        `find_timeout_s`."""
        samples: list[tuple[float, dict[str, int]]] = []
        deadline = time.monotonic() + self.find_timeout_s
        while time.monotonic() < deadline:
            now = time.monotonic()
            samples.append((now, self._received()))
            samples = [(t, s) for t, s in samples if now - t <= TRANSFER_WINDOW_S]
            first = samples[0][1]
            for host in self.decoders:
                if samples[-1][1][host] - first[host] >= IN_TRANSFER_BYTES:
                    return host
            await asyncio.sleep(0.02)
        return None

    async def streaming(self) -> str:
        """The decode host that sent the most over its link in the last second (its
        streams' tokens, going to the router)."""
        before = self._sent()
        await asyncio.sleep(1.0)
        after = self._sent()
        return max(self.decoders, key=lambda h: after[h] - before[h])

    async def begin(self, kind: str, amount: float) -> tuple[str, Callable[[], None]]:
        """Start fault `kind` (see services/bench/faults.py's NET_KINDS); `amount` is the
        loss share or the delay in ms. Returns what it hit and the undo."""
        fabric = self.fabric
        if kind == "cut-prefill-decode":
            host = await self.receiving_kv()
            if host is None:
                raise RuntimeError(f"no KV transfer to a decode host seen within "
                                   f"{self.find_timeout_s:g} s")
            fabric.cut_between("prefill", host)
            return f"prefill<->{host}", lambda: fabric.restore_between("prefill", host)
        if kind == "cut-decode-router":
            host = await self.streaming()
            fabric.cut_between("router", host)
            return f"router<->{host}", lambda: fabric.restore_between("router", host)
        if kind == "cut-router-redis":
            fabric.cut_between("router", "redis")
            return "router<->redis", lambda: fabric.restore_between("router", "redis")
        if kind in ("partition-decode", "partition-prefill"):
            host = await self.streaming() if kind == "partition-decode" else "prefill"
            fabric.cut(host)
            return f"{host}<->everyone", lambda: fabric.restore(host)
        hosts = list(fabric.hosts)
        if kind == "loss":
            def lose() -> None:
                for h in hosts:
                    fabric.lose(h, amount)

            def unlose() -> None:
                for h in hosts:
                    fabric.unlose(h)
            try:  # off the event loop: the streams being measured run on it
                await asyncio.to_thread(lose)
            except BaseException:
                unlose()
                raise
            return "every host's link", unlose
        if kind == "latency":
            def delay() -> None:
                for h in hosts:
                    fabric.delay(h, amount, self.workdir / f"delay-{h}.log")
            try:
                await asyncio.to_thread(delay)
            except BaseException:
                for h in hosts:
                    fabric.undelay(h)
                raise

            def undelay() -> None:
                for h in hosts:
                    fabric.undelay(h)
            return "every host's link", undelay
        raise ValueError(f"not a network fault: {kind!r}")
