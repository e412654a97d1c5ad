"""The registry on a real redis-server: authentication, TLS, poisoned records, client
leases that outlive no router, and `pdserve scale`/`down` answers without a stack."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis as sync_redis
from prometheus_client import REGISTRY

from services.launcher.scale import LauncherError, set_desired
from services.registry.records import WorkerRecord
from services.registry.redis_server import RedisServer
from services.registry.registry import Registry
from services.registry.signing import RecordSigner

SECRET = b"cluster-secret-for-tests-0123456789"


def bad_records(reason: str) -> float:
    return REGISTRY.get_sample_value("pdserve_registry_bad_records_total",
                                     {"reason": reason}) or 0.0


def worker(worker_id: str, **changes: object) -> WorkerRecord:
    fields: dict[str, object] = dict(
        worker_id=worker_id, role="decode", address="127.0.0.1:5000", host="h", epoch=1,
        fingerprint="f", kv_address="127.0.0.1:5001", kv_transport="grpc",
        updated=time.time())
    fields.update(changes)
    return WorkerRecord(**fields)  # type: ignore[arg-type]


@pytest.fixture
async def registry(redis: RedisServer) -> AsyncIterator[Registry]:
    r = Registry.from_url(redis.url, signer=RecordSigner(SECRET), ttl_s=30)
    await r.redis.flushdb()
    yield r
    await r.close()


def test_redis_needs_the_password_and_keeps_it_off_the_command_line(redis: RedisServer
                                                                     ) -> None:
    assert redis.password and f":{redis.password}@" in redis.url.replace("%", "")
    anonymous = sync_redis.Redis(host="127.0.0.1", port=redis.port, socket_timeout=2)
    with pytest.raises(sync_redis.AuthenticationError):
        anonymous.ping()
    wrong = sync_redis.Redis(host="127.0.0.1", port=redis.port, password="guess",
                             socket_timeout=2)
    with pytest.raises(sync_redis.AuthenticationError):
        wrong.ping()
    assert sync_redis.Redis.from_url(redis.url).ping()
    assert redis.proc is not None
    cmdline = Path(f"/proc/{redis.proc.pid}/cmdline").read_bytes()
    assert redis.password.encode() not in cmdline
    # The config file (mode 0600, in a 0700 folder) is read once, at start: the password
    # is no longer on disk once the server answers.
    assert not redis.dir.exists()


async def test_tls_to_redis() -> None:
    server = RedisServer(tls=True).start()
    try:
        assert server.url.startswith("rediss://")
        registry = Registry.from_url(server.url, signer=RecordSigner(SECRET), ttl_s=30)
        try:
            await registry.heartbeat(worker("decode-tls"))
            assert [w.worker_id for w in await registry.workers()] == ["decode-tls"]
        finally:
            await registry.close()
        plain = sync_redis.Redis(host="127.0.0.1", port=server.port, password=server.password,
                                 socket_timeout=2)
        with pytest.raises(sync_redis.ConnectionError):
            plain.ping()
    finally:
        server.cleanup()


async def test_poisoned_records_are_skipped_logged_once_and_counted(
        registry: Registry, caplog: pytest.LogCaptureFixture) -> None:
    await registry.heartbeat(worker("decode-good"))
    forger = Registry(registry.redis, signer=RecordSigner(b"not-the-secret-0123456789"),
                      ttl_s=30)
    await forger.heartbeat(worker("decode-forged", address="127.0.0.1:6666"))
    unsigned = Registry(registry.redis, signer=RecordSigner(None), ttl_s=30)
    await unsigned.heartbeat(worker("decode-unsigned"))
    stale = worker("decode-stale", updated=time.time() - 3600)
    await registry.heartbeat(stale)
    ns = registry.ns
    raw = {
        "decode-json": b"{this is not json",
        "decode-bytes": b"\xff\xfe\x00",
        "decode-types": RecordSigner(SECRET).seal("worker", {
            **worker("decode-types").to_dict(), "epoch": "one"}),
        "decode-role": RecordSigner(SECRET).seal("worker", worker("decode-role",
                                                                  role="boss").to_dict()),
        "decode-renamed": RecordSigner(SECRET).seal("worker",
                                                    worker("decode-good").to_dict()),
    }
    for worker_id, value in raw.items():
        await registry.redis.set(f"{ns}w:{worker_id}", value)
        await registry.redis.sadd(f"{ns}workers", worker_id)
    before = {r: bad_records(r) for r in ("json", "schema", "signature", "stale")}
    caplog.set_level(logging.WARNING, logger="services.registry.registry")
    for _ in range(3):
        view = await registry.workers()
        assert [w.worker_id for w in view] == ["decode-good"]
    after = {r: bad_records(r) - before[r] for r in before}
    # each bad value counted once however often it is read
    assert after == {"json": 2, "schema": 3, "signature": 2, "stale": 1}
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 8 and len({m.split("'")[1] for m in skipped}) == 8
    # a new bad value of the same worker is counted again, and logged no more
    await registry.redis.set(f"{ns}w:decode-json", b"{still not json")
    await registry.workers()
    assert bad_records("json") - before["json"] == 3
    # once good again, the worker is back
    await registry.heartbeat(worker("decode-json"))
    assert {w.worker_id for w in await registry.workers()} == {"decode-good", "decode-json"}


async def test_a_worker_set_of_the_wrong_type_neither_crashes_readers_nor_blocks_workers(
        registry: Registry) -> None:
    await registry.redis.set(f"{registry.ns}workers", "poison")
    assert await registry.workers() == []
    await registry.heartbeat(worker("decode-0"))
    assert [w.worker_id for w in await registry.workers()] == ["decode-0"]


async def test_client_leases_bound_a_client_and_come_back_on_release(registry: Registry
                                                                     ) -> None:
    leases = [await registry.acquire_client_lease("alice", 2) for _ in range(3)]
    assert leases[0] and leases[1] and leases[2] is None
    assert await registry.acquire_client_lease("bob", 2) is not None  # per client
    await registry.release_client_lease(leases[0])
    assert await registry.acquire_client_lease("alice", 2) is not None


HOLDER = """
import asyncio, sys
from services.registry.registry import Registry
from services.registry.signing import RecordSigner

async def main():
    registry = Registry.from_url(sys.argv[1], signer=RecordSigner(None), client_lease_s=1.5)
    for _ in range(2):
        assert await registry.acquire_client_lease("dave", 2)
    print("held", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_crashed_routers_client_leases_come_back(redis: RedisServer,
                                                         registry: Registry) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, redis.url],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        # renewed while the holder lives: still full after three lease lengths
        deadline = time.monotonic() + 4.5
        while time.monotonic() < deadline:
            assert await registry.acquire_client_lease("dave", 2) is None
            await asyncio.sleep(0.3)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        killed = time.monotonic()
        while await registry.acquire_client_lease("dave", 2) is None:
            assert time.monotonic() - killed < 10, "the crashed holder's leases never lapsed"
            await asyncio.sleep(0.1)
        # both came back, and the key itself expires with its last lease
        assert await registry.acquire_client_lease("dave", 2) is not None
        assert 0 < await registry.redis.pttl(f"{registry.ns}lease:dave") <= 15_000
    finally:
        if holder.poll() is None:
            holder.kill()


async def test_scale_and_down_without_a_stack_say_what_to_do(
        redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_STATE_FILE", str(tmp_path / "none.json"))
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET", raising=False)
    with pytest.raises(LauncherError, match="--redis-url"):
        await set_desired("", {"down": True})
    sync_redis.Redis.from_url(redis.url).delete("pdserve:desired")
    with pytest.raises(LauncherError, match="`pdserve up`") as e:
        await set_desired(redis.url, {"decode": 2}, wait_s=0.5)
    assert redis.password not in str(e.value)
    anonymous = f"redis://127.0.0.1:{redis.port}/0"
    with pytest.raises(LauncherError, match="password"):
        await set_desired(anonymous, {"decode": 2}, wait_s=0.5)
    # The command line: one line, no traceback, no password.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://:hunter2@127.0.0.1:{s.getsockname()[1]}/0"
    out = subprocess.run([sys.executable, "-m", "services.cli", "down", "--redis-url", dead],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PDSERVE_STATE_FILE": str(tmp_path / "x.json")})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "cannot reach" in out.stderr
    assert "hunter2" not in out.stderr


async def test_client_leases_fall_back_to_the_routers_own_count_while_redis_is_away(
        ) -> None:
    """Redis stops answering: leases are granted on this router's own count (the limit
    still holds for its requests) instead of failing the requests, and are released
    without Redis; once Redis answers again, leases are Redis's again."""
    server = RedisServer().start()
    registry = Registry.from_url(server.url, signer=RecordSigner(None))
    try:
        held = await registry.acquire_client_lease("erin", 2)
        assert held is not None and not held.local
        server.cleanup()  # Redis is gone
        local = await registry.acquire_client_lease("erin", 2)
        assert local is not None and local.local
        # this router holds both of erin's slots now: the third is refused, not failed
        assert await registry.acquire_client_lease("erin", 2) is None
        await registry.release_client_lease(local)  # never reaches Redis
        assert registry.leases.held("erin") == 1
    finally:
        await registry.close()
        server.cleanup()
