"""The network faults of the chaos benchmark on the bare fabric (no pdserve, no engines):
each does to the packets between two hosts what it says, and its undo gives the link back.
Two hosts, one of them serving TCP; the other connects and echoes.

- `delay`: a round trip through the host grows by the delay (held once on the way in,
  and once at the peer's way in), where no netem exists.
- `lose`: a share of the packets never arrives; most do.
- `cut_between` and `cut`: nothing passes, and after the restore everything does.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.bench.netns import Fabric, FabricError, stop_group, unavailable, wait_for

pytestmark = [pytest.mark.netns]

PORT = 7300
ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64)
while True:
    c, _ = s.accept()
    while (b := c.recv(65536)):
        c.sendall(b)
    c.close()
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fabric, Path]]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network-namespace tests: {reason}")
    fabric = Fabric.create(["server", "client"])
    logs = tmp_path_factory.mktemp("faults")
    echo = fabric.popen("server", [sys.executable, "-c", ECHO, fabric.addr("server"),
                                   str(PORT)], logs / "echo.log")
    try:
        wait_for(lambda: f"{fabric.addr('server')}:{PORT}" in fabric.listeners("server"),
                 15, "the echo server listening")
        yield fabric, logs
    finally:
        stop_group(echo, timeout=5)
        fabric.heal()
        fabric.close()


def round_trips(fabric: Fabric, n: int, timeout: float = 2.0) -> list[float | None]:
    """`n` one-byte echoes over one TCP connection from the client host: each round
    trip's seconds, None for one that got no answer within `timeout` (the rest are then
    not tried: the connection is stuck)."""
    code = f"""
import socket, time
s = socket.create_connection(("{fabric.addr('server')}", {PORT}), timeout={timeout})
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range({n}):
    t = time.perf_counter()
    try:
        s.sendall(b"x"); s.recv(1)
        print(time.perf_counter() - t, flush=True)
    except OSError:
        print("none", flush=True)
        break
"""
    out = fabric.run("client", [sys.executable, "-c", code], check=False)
    got: list[float | None] = [None if w == "none" else float(w) for w in out.stdout.split()]
    if not got:
        got = [None]  # not even connected within the timeout
    return got


def connects(fabric: Fabric, tries: int, timeout: float = 0.5) -> int:
    """How many of `tries` fresh TCP connections from the client host succeed, each
    given `timeout` (a dropped SYN is retried by the kernel only after a second)."""
    code = f"""
import socket
ok = 0
for _ in range({tries}):
    try:
        socket.create_connection(("{fabric.addr('server')}", {PORT}), timeout={timeout}).close()
        ok += 1
    except OSError:
        pass
print(ok)
"""
    return int(fabric.run("client", [sys.executable, "-c", code]).stdout)


def reachable_again(fabric: Fabric, within_s: float = 10.0) -> bool:
    """Whether a connection gets through within `within_s` of a restore: a bridge port
    brought back up forwards again after a moment, not at once."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if connects(fabric, 1):
            return True
    return False


def test_delay_holds_each_packet_a_host_receives(pair: tuple[Fabric, Path]) -> None:
    fabric, logs = pair
    base = round_trips(fabric, 10)
    assert all(t is not None and t < 0.05 for t in base), base
    try:
        for host in ("server", "client"):
            fabric.delay(host, 60, logs / f"delay-{host}.log")
        held = round_trips(fabric, 10)
    except FabricError as e:
        if "NetfilterQueue" in str(e):
            pytest.skip(str(e))
        raise
    finally:
        for host in ("server", "client"):
            fabric.undelay(host)
    # 60 ms on the way in to each end: at least 120 ms a round trip, and not seconds.
    assert all(t is not None and 0.12 <= t < 0.6 for t in held), held
    after = round_trips(fabric, 10)
    assert all(t is not None and t < 0.05 for t in after), after


def test_loss_drops_a_share_and_its_undo_none(pair: tuple[Fabric, Path]) -> None:
    fabric, _ = pair
    assert connects(fabric, 20) == 20
    fabric.lose("server", 0.5)
    try:
        # A try fails when its SYN is dropped (the kernel's retry comes after the
        # timeout): about half of them at a 50% loss. 40 tries all passing, or all
        # failing, would be odds of one in 10^12.
        lossy = connects(fabric, 40)
    finally:
        fabric.unlose("server")
    assert 0 < lossy < 40, lossy
    assert connects(fabric, 20) == 20


def test_cuts_stop_everything_until_restored(pair: tuple[Fabric, Path]) -> None:
    fabric, _ = pair
    for cut, restore in ((lambda: fabric.cut_between("client", "server"),
                          lambda: fabric.restore_between("client", "server")),
                         (lambda: fabric.cut("server"), lambda: fabric.restore("server"))):
        cut()
        try:
            assert connects(fabric, 3, timeout=0.3) == 0
        finally:
            restore()
        assert reachable_again(fabric)
        assert connects(fabric, 5) == 5
    # heal() undoes whatever is still in place.
    fabric.cut_between("client", "server")
    fabric.lose("client", 0.9)
    fabric.heal()
    assert connects(fabric, 5) == 5
