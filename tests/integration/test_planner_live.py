"""The live planner's round in `pdserve up`, against a real redis-server holding worker
records written by the real registry and the signed desired state, and real Prometheus
endpoints over HTTP. The endpoints serve vLLM's request-length histograms with values
the test sets (named `FakeVllmMetrics`: a traffic mix no 2-core machine could serve, so
the decision can be checked); test_launcher.py reads the same histograms off a real
decode worker."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from services.launcher.desired import Desired, DesiredState
from services.launcher.planning import _round
from services.launcher.watch import Watch
from services.plan.costmodel import Profile
from services.plan.live import OUTPUT, PROMPT, LivePlanner, PlannerSettings, TrafficMeter
from services.registry.records import WorkerRecord
from services.registry.redis_server import RedisServer
from services.registry.registry import Registry
from services.registry.signing import RecordSigner
from services.server.channels import free_port
from services.traffic.slo import SLOs
from tests.unit.test_plan_live import BUCKETS, GPU_PROFILE

SECRET = b"planner-test-secret-0123456789abcdef"


class FakeVllmMetrics:
    """A Prometheus endpoint with vLLM's request-length histograms, fed by the test."""

    def __init__(self) -> None:
        self.port = free_port()
        reg = CollectorRegistry()
        self.prompt = Histogram(PROMPT, "", buckets=BUCKETS, registry=reg)
        self.output = Histogram(OUTPUT, "", buckets=BUCKETS, registry=reg)
        self.server, _ = start_http_server(self.port, "127.0.0.1", registry=reg)

    def finish(self, n: int, prompt: float, output: float) -> None:
        rng = np.random.default_rng(n)
        for p, o in zip(rng.normal(prompt, prompt / 5, n), rng.normal(output, output / 5, n),
                        strict=True):
            self.prompt.observe(max(1.0, p))
            self.output.observe(max(1.0, o))


@pytest.fixture
def decode_metrics() -> Iterator[list[FakeVllmMetrics]]:
    eps = [FakeVllmMetrics(), FakeVllmMetrics()]
    yield eps
    for ep in eps:
        ep.server.shutdown()


@pytest.fixture
async def registry(redis: RedisServer) -> AsyncIterator[Registry]:
    reg = Registry.from_url(redis.url, ttl_s=60.0, signer=RecordSigner(SECRET))
    await reg.redis.flushdb()
    yield reg
    await reg.close()


def record(worker_id: str, role: str, metrics_port: int) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, address=f"127.0.0.1:{free_port()}",
                        host="node-1", epoch=1, fingerprint="f" * 16,
                        kv_address="127.0.0.1:1" if role == "decode" else "",
                        kv_transport="torch" if role == "decode" else "",
                        metrics_port=metrics_port, capacity=8, updated=time.time())


async def test_a_round_moves_workers_to_where_the_observed_traffic_needs_them(
        registry: Registry, decode_metrics: list[FakeVllmMetrics]) -> None:
    # 1 prefill and 7 decode GPUs (8 in all) serving long prompts: the traffic both decode
    # workers report (and nothing from the prefill worker, which finishes no request)
    # makes the planner move GPUs to prefill, through the signed desired state.
    for i, ep in enumerate(decode_metrics):
        await registry.heartbeat(record(f"decode-{i}", "decode", ep.port))
    await registry.heartbeat(record("prefill-0", "prefill", free_port()))
    state = DesiredState(registry.redis, RecordSigner(SECRET))
    desired = Desired(1, 7, stack="s1").updated()
    await state.write(desired)
    watch = Watch(state, desired, None)
    planner = LivePlanner(Profile.load(GPU_PROFILE),
                          PlannerSettings(SLOs(ttft_s=2.0, itl_s=0.1), cooldown_s=600.0),
                          transport="torch")
    meter = TrafficMeter()
    await _round(planner, meter, registry, watch)  # the first look starts the window
    assert await state.read() == desired
    for ep in decode_metrics:
        ep.finish(360, prompt=6000, output=150)  # 12 requests/s over 60 s, in all
    meter.last_at = time.monotonic() - 60.0  # as if the interval had passed
    await _round(planner, meter, registry, watch)
    got = await state.read()
    assert got is not None and got.stack == "s1" and got.version > desired.version
    assert got.prefill >= 3 and got.prefill + got.decode == 8, got
    assert watch.desired == got
    # More of the same right after: the cool-down holds the split.
    for ep in decode_metrics:
        ep.finish(360, prompt=6000, output=150)
    meter.last_at = time.monotonic() - 60.0
    await _round(planner, meter, registry, watch)
    assert await state.read() == got
