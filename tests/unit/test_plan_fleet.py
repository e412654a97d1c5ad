"""Invariants of the fleet simulation and the predictions built on it (pure logic, on a
hand-written cost model: no engine)."""

from __future__ import annotations

import pytest

from services.plan.configs import configurations
from services.plan.costmodel import Profile, StepCost, Transport
from services.plan.fleet import Fleet, FleetConfig, PoolSpec, SimRequest
from services.plan.predict import close_calls, predict_all, rank, schedule, simulate
from services.traffic.arrivals import ArrivalConfig
from services.traffic.slo import SLOs
from services.traffic.workload import LengthDist, WorkloadConfig

TWO = StepCost(0.03, 0.0009, 0.0015, 0.0005, 0.01, 0.01)
ONE = StepCost(0.045, 0.0018, 0.0025, 0.001, 0.02, 0.01)
WORKLOAD = WorkloadConfig(dataset="mixed", num_requests=80, input_len=LengthDist(100),
                          output_len=LengthDist(64), long_share=0.2,
                          long_input_len=LengthDist(1500), long_output_len=LengthDist(8))
ARRIVALS = ArrivalConfig(rate=1.0, duration_s=40, warmup_s=5)


def profile() -> Profile:
    """A made-up two-core profile (a fake: the numbers are chosen, not measured)."""
    return Profile({"kind": "cpu"}, {"name": "fake", "layers": 30}, {}, "core",
                   {1: ONE, 2: TWO}, {"grpc": Transport(0.6, 1.5)}, 2048, 64, 46080, 40000, 2)


def requests(rate: float = 1.0) -> list[SimRequest]:
    reqs, _ = schedule(WORKLOAD, ArrivalConfig(rate=rate, duration_s=40), 80)
    return reqs


CONFIGS = [
    FleetConfig("colocated", PoolSpec(1, 2)),
    FleetConfig("colocated_b256", PoolSpec(1, 2, 256)),
    FleetConfig("disagg", PoolSpec(1, 1), PoolSpec(1, 1)),
    FleetConfig("conditional", PoolSpec(1, 1), PoolSpec(1, 1), local_prefill_max_tokens=256),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_every_request_finishes_once_with_all_its_tokens(cfg: FleetConfig) -> None:
    reqs = requests(1.5)
    results = Fleet(cfg, profile()).run(reqs)
    assert len(results) == len(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert res.ok and res.request is req
        assert len(res.token_times) == req.out  # every token exactly once
        assert res.token_times[0] >= req.send_s
        assert res.token_times == sorted(res.token_times)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_prompt_tokens_are_conserved(cfg: FleetConfig) -> None:
    reqs = requests()
    fleet = Fleet(cfg, profile())
    results = fleet.run(reqs)
    for engine in fleet.engines:
        assert engine.queued_tokens == 0 and engine.kv_used == 0
        assert engine.running == 0 and not engine.waiting
    shipped = [r for r in results if r.path == "shipped"]
    if cfg.prefill is None:
        assert not shipped
    elif cfg.local_prefill_max_tokens:
        assert {r.request.kind for r in shipped} == {"long"}
    else:
        assert len(shipped) == len(reqs)


def test_the_same_seed_gives_the_same_prediction() -> None:
    a = [simulate(c, profile(), *schedule(WORKLOAD, ARRIVALS, 80), 1.0, 70, SLOs(ttft_s=4))
         for c in CONFIGS]
    b = [simulate(c, profile(), *schedule(WORKLOAD, ARRIVALS, 80), 1.0, 70, SLOs(ttft_s=4))
         for c in CONFIGS]
    assert [p.row() for p in a] == [p.row() for p in b]


def test_another_seed_gives_another_schedule() -> None:
    a, _ = schedule(WORKLOAD, ARRIVALS, 80)
    b, _ = schedule(WORKLOAD, ArrivalConfig(rate=1.0, duration_s=40, warmup_s=5, seed=1), 80)
    assert [r.send_s for r in a] != [r.send_s for r in b]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_goodput_is_monotone_in_the_slo(cfg: FleetConfig) -> None:
    reqs, warmup = schedule(WORKLOAD, ARRIVALS, 80)
    goodputs = [simulate(cfg, profile(), reqs, warmup, 1.0, 70,
                         SLOs(ttft_s=t, tpot_s=t / 20)).summary["goodput"]
                for t in (0.5, 1, 2, 4, 8, 1e9)]
    assert goodputs == sorted(goodputs)
    assert goodputs[-1] > 0


def test_shipped_tokens_wait_for_the_kv() -> None:
    reqs = [SimRequest(0.0, 1500, 4, "long")]
    cfg = FleetConfig("disagg", PoolSpec(1, 1), PoolSpec(1, 1))
    prof = profile()
    (res,) = Fleet(cfg, prof).run(reqs)
    transfer = prof.transports["grpc"].transfer_s(1500 * prof.kv_bytes_per_token)
    assert res.path == "shipped"
    assert res.token_times[1] - ONE.request_s >= transfer  # the 2nd token after the KV


def test_requests_past_the_horizon_fail() -> None:
    reqs = requests(4.0)  # 80 requests in 20 s: the queue outlasts a 15 s horizon
    results = Fleet(CONFIGS[0], profile()).run(reqs, horizon_s=15.0)
    assert any(not r.ok for r in results) and any(r.ok for r in results)
    assert all(r.end_s <= 15.0 for r in results if r.ok)


def test_ten_configurations_at_four_rates_are_fast() -> None:
    cfgs = configurations(profile(), 2, budgets=(128, 256, 512, 1024))
    assert len(cfgs) == 10
    preds, took = predict_all(cfgs, profile(), WORKLOAD, ARRIVALS, [0.5, 1, 1.5, 2], 80,
                              SLOs(ttft_s=4, tpot_s=0.1))
    assert len(preds) == 40
    assert took < 30  # the goal; a few seconds in practice
    names = [name for name, _, _ in rank(preds)]
    assert sorted(names) == sorted(c.name for c in cfgs)


def test_close_calls_are_the_configurations_within_the_planners_error_of_the_first() -> None:
    ranking = [("a", 1.0, [1.0]), ("b", 0.85, [0.85]), ("c", 0.79, [0.79])]
    assert close_calls(ranking) == ["b"]
    assert close_calls(ranking, margin=0.25) == ["b", "c"]
    assert close_calls([("a", 0.0, [0.0]), ("b", 0.0, [0.0])]) == []  # nothing serves: no call
    assert close_calls([]) == []


def test_a_transport_the_profile_lacks_says_how_to_get_it() -> None:
    # one disaggregated pair, on more cores than the profiled host: no shared memory
    nixl = FleetConfig("disagg", PoolSpec(2, 1), PoolSpec(2, 1), transport="nixl")
    with pytest.raises(ValueError, match=r"no transport 'nixl'.*pdserve plan profile.*grpc"):
        Fleet(nixl, profile())
    with_nixl = profile()
    with_nixl.transports["nixl"] = Transport(3.0, 0.3)
    assert Fleet(nixl, with_nixl).transport == "nixl"
