"""`pdserve top` against a real redis-server holding worker records written by the real
registry, and real Prometheus endpoints over HTTP. The endpoints serve counters the test
sets (named `FakeWorkerMetrics`: they stand in for the workers' vLLM metrics so every
figure can be checked exactly); the stack test in test_tracing.py reads real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from services.observability.fleet import Fleet, Row
from services.registry.records import WorkerLoad, WorkerRecord
from services.registry.redis_server import RedisServer
from services.registry.registry import Registry
from services.server.channels import free_port


class FakeWorkerMetrics:
    """A Prometheus endpoint with the counters top reads, set by the test."""

    def __init__(self, *, migrations: bool = False) -> None:
        self.port = free_port()
        reg = CollectorRegistry()
        self.prompt = Counter("vllm:prompt_tokens", "", registry=reg)
        self.generation = Counter("vllm:generation_tokens", "", registry=reg)
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "", registry=reg)
        self.kv_failures = Counter("pdserve_kv_transfer_failures", "", ["policy"], registry=reg)
        self.finished = Counter("vllm:request_success", "", ["finished_reason"], registry=reg)
        self.migrations = (Counter("pdserve_migrations", "", ["reason", "worker"], registry=reg)
                           if migrations else None)
        self.server, self.thread = start_http_server(self.port, "127.0.0.1", registry=reg)

    def stop(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def endpoints() -> Iterator[dict[str, FakeWorkerMetrics]]:
    eps = {"prefill-a": FakeWorkerMetrics(), "decode-a": FakeWorkerMetrics(),
           "router": FakeWorkerMetrics(migrations=True)}
    yield eps
    for ep in eps.values():
        ep.stop()


def record(worker_id: str, role: str, metrics_port: int, epoch: int = 1,
           load: WorkerLoad | None = None) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, address=f"127.0.0.1:{free_port()}",
                        host="node-1", epoch=epoch, fingerprint="f" * 16,
                        kv_address="127.0.0.1:1" if role == "decode" else "",
                        kv_transport="grpc" if role == "decode" else "",
                        metrics_port=metrics_port, capacity=8,
                        load=load or WorkerLoad(), updated=time.time())


@pytest.fixture
async def registry(redis: RedisServer) -> Iterator[Registry]:  # type: ignore[misc]
    reg = Registry.from_url(redis.url, ttl_s=60.0)
    await reg.redis.flushdb()
    yield reg
    await reg.close()


def top(redis: RedisServer, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "top", "--redis-url",
                           redis.url, "--interval", "0.2", "--once", *extra],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ))


async def test_rates_are_counter_deltas_over_the_time_between_scrapes(
        registry: Registry, endpoints: dict[str, FakeWorkerMetrics]) -> None:
    p, d, router = endpoints["prefill-a"], endpoints["decode-a"], endpoints["router"]
    await registry.heartbeat(record("prefill-a", "prefill", p.port,
                                    load=WorkerLoad(waiting=3, running=1, kv_usage=0.25)))
    await registry.heartbeat(record("decode-a", "decode", d.port,
                                    load=WorkerLoad(running=5, kv_usage=0.5)))
    fleet = Fleet(registry, routers=[f"127.0.0.1:{router.port}"])
    t0 = time.monotonic()
    first = await fleet.snapshot()
    t1 = time.monotonic()
    assert [r.prompt_tokens_per_s for r in first.rows] == [None, None]  # one scrape: no rate
    p.prompt.inc(4000)
    d.generation.inc(300)
    d.kv_bytes.inc(2e9)
    d.kv_failures.labels("recompute").inc(2)
    d.finished.labels("error").inc()
    d.finished.labels("stop").inc(9)  # not an error
    assert router.migrations is not None
    router.migrations.labels("stream_reset", "decode-a").inc(3)
    time.sleep(0.3)
    t2 = time.monotonic()
    second = await fleet.snapshot()
    t3 = time.monotonic()
    shortest, longest = t2 - t1, t3 - t0  # the scrapes were this far apart, at least/most
    rows: dict[str, Row] = {r.worker_id: r for r in second.rows}
    pre, dec = rows["prefill-a"], rows["decode-a"]
    assert [r.worker_id for r in second.rows] == ["prefill-a", "decode-a"]
    assert (pre.role, pre.host, pre.epoch, pre.queue, pre.running, pre.kv_usage) == (
        "prefill", "node-1", 1, 3, 1, 0.25)
    assert pre.prompt_tokens_per_s is not None and dec.kv_gbytes_per_s is not None
    assert 4000 / longest <= pre.prompt_tokens_per_s <= 4000 / shortest
    assert 2.0 / longest <= dec.kv_gbytes_per_s <= 2.0 / shortest
    assert dec.generation_tokens_per_s is not None
    assert 300 / longest <= dec.generation_tokens_per_s <= 300 / shortest
    assert pre.generation_tokens_per_s == 0.0
    assert (dec.errors, pre.errors) == (3, 0)
    assert (dec.migrations, pre.migrations) == (3, 0)
    assert second.routers == {f"127.0.0.1:{router.port}": 3.0}


async def test_a_restarted_worker_has_no_rate_until_its_next_scrape(
        registry: Registry, endpoints: dict[str, FakeWorkerMetrics]) -> None:
    p = endpoints["prefill-a"]
    rec = record("prefill-a", "prefill", p.port)
    await registry.heartbeat(rec)
    fleet = Fleet(registry)
    await fleet.snapshot()
    await registry.heartbeat(replace(rec, epoch=2, updated=time.time()))
    (row,) = (await fleet.snapshot()).rows
    assert row.epoch == 2 and row.prompt_tokens_per_s is None and row.metrics
    assert row.migrations is None  # no router was asked


async def test_once_json_and_table(registry: Registry, redis: RedisServer,
                                   endpoints: dict[str, FakeWorkerMetrics]) -> None:
    await registry.heartbeat(record("prefill-a", "prefill", endpoints["prefill-a"].port,
                                    load=WorkerLoad(waiting=2, running=1, kv_usage=0.125)))
    # Registered with a metrics port nobody listens on (as a pod IP seen from outside).
    await registry.heartbeat(record("decode-a", "decode", free_port()))
    out = top(redis, "--json")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    rows = {r["worker_id"]: r for r in snap["workers"]}
    assert set(rows) == {"prefill-a", "decode-a"}
    assert (rows["prefill-a"]["queue"], rows["prefill-a"]["kv_usage"]) == (2, 0.125)
    assert rows["prefill-a"]["metrics"] is True
    assert rows["prefill-a"]["prompt_tokens_per_s"] == 0.0  # nothing moved between scrapes
    dead = rows["decode-a"]
    assert dead["metrics"] is False and dead["prompt_tokens_per_s"] is None
    assert dead["errors"] is None and dead["role"] == "decode"
    # --metrics points a worker at a reachable endpoint (a port-forward).
    forwarded = top(redis, "--json", "--metrics",
                    f"decode-a=127.0.0.1:{endpoints['decode-a'].port}")
    assert {r["worker_id"]: r["metrics"] for r in json.loads(forwarded.stdout)["workers"]} \
        == {"prefill-a": True, "decode-a": True}
    table = top(redis)
    assert table.returncode == 0, table.stderr
    for text in ("prefill-a", "decode-a", "12.5%", "1/8", "metrics not reachable"):
        assert text in table.stdout
    assert redis.password not in table.stdout  # the URL is shown without its password


def test_unreachable_redis_and_bad_flags_are_clear_errors() -> None:
    out = subprocess.run([sys.executable, "-m", "services.observability.top", "--redis-url",
                          f"redis://127.0.0.1:{free_port()}/0", "--once"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1].startswith("error: cannot read the registry")
    assert "Traceback" not in out.stderr
    bad = subprocess.run([sys.executable, "-m", "services.observability.top", "--redis-url",
                          "redis://127.0.0.1:1/0", "--once", "--metrics", "nohost"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "WORKER=HOST:PORT" in bad.stderr
