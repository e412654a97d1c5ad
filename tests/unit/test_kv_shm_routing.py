"""Which sender a prefill job goes to, and how same-host fallbacks are counted and
exported (pure logic: no transfer starts here)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from services.kv.fingerprint import LayoutFingerprint, PeerIdentity
from services.kv.metadata import SaveJob
from services.kv.params import SendParams
from services.kv.producer import Producer
from services.kv.stats import FALLBACKS, FallbackMetrics, PdserveKVStats
from services.kv.transport import TransportConfig

FP = LayoutFingerprint("m", "float32", 16, 4, 3, 64, "cpu:avx2", "0.1.0")
ME = PeerIdentity("prefill-0", 1, FP)


def job(same_host: bool, address: str = "127.0.0.1:5000") -> SaveJob:
    return SaveJob("r", "t", address, "grpc", 1, "d", [0], 10, same_host=same_host)


def test_same_host_jobs_use_shm_unless_it_is_off() -> None:
    on = Producer(ME, TransportConfig(), 30.0, False, shm=True)
    assert on._route(job(False)) == "grpc"
    assert on._route(job(True)) == "shm:grpc"
    assert on.take_fallbacks() == {}
    off = Producer(ME, TransportConfig(), 30.0, False, shm=False)
    assert off._route(job(True)) == "grpc" and off._route(job(True)) == "grpc"
    assert off._route(job(False)) == "grpc"  # not same-host: no fallback to count
    assert off.take_fallbacks() == {"shm_disabled": 2} and off.take_fallbacks() == {}


def test_a_peer_where_shm_failed_goes_straight_to_the_network() -> None:
    p = Producer(ME, TransportConfig(), 30.0, False, shm=True)
    p._no_shm["127.0.0.1:5000"] = "receiver_refuses_shm"
    assert p._route(job(True)) == "grpc"
    assert p._route(job(True, "127.0.0.1:6000")) == "shm:grpc"
    assert p.take_fallbacks() == {"receiver_refuses_shm": 1}


def test_send_params_carry_same_host() -> None:
    assert SendParams("t", "a:1", "grpc", 1, "d").to_params()["pdserve"]["same_host"] is False
    params = SendParams("t", "a:1", "grpc", 1, "d", same_host=True).to_params()
    assert params["pdserve"]["same_host"] is True
    assert SendParams.of(params) == SendParams("t", "a:1", "grpc", 1, "d", same_host=True)


def test_fallback_stats_aggregate_and_reach_prometheus() -> None:
    a = PdserveKVStats({FALLBACKS: {"shm_disabled": 2}})
    b = PdserveKVStats({FALLBACKS: {"shm_disabled": 1, "shm_setup_failed": 4}})
    total = a.aggregate(b)
    assert total.data == {FALLBACKS: {"shm_disabled": 3, "shm_setup_failed": 4}}
    assert not total.is_empty() and PdserveKVStats({FALLBACKS: {}}).is_empty()
    metrics = FallbackMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    metrics.observe(total.data, 0)
    labels = {"model_name": "m", "engine": "0", "reason": "shm_setup_failed"}
    assert REGISTRY.get_sample_value("pdserve_kv_transport_fallbacks_total", labels) == 4
