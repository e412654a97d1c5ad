"""Arrival schedules: statistics with a fixed seed, exact cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.traffic.arrivals import ArrivalConfig, send_offsets


def gaps(offsets: np.ndarray) -> np.ndarray:
    return np.diff(offsets)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert np.array_equal(send_offsets(ArrivalConfig(), 5), np.zeros(5))


def test_first_request_goes_at_zero_and_offsets_rise() -> None:
    off = send_offsets(ArrivalConfig(rate=5.0, seed=1), 100)
    assert off[0] == 0.0
    assert np.all(np.diff(off) >= 0)


def test_poisson_gaps_have_mean_one_over_rate_and_unit_cv() -> None:
    g = gaps(send_offsets(ArrivalConfig(rate=10.0, seed=7), 20_001))
    assert g.mean() == pytest.approx(0.1, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)


def test_gamma_burstiness_sets_the_spread_not_the_mean() -> None:
    bursty = gaps(send_offsets(ArrivalConfig(rate=10.0, process="gamma", burstiness=0.25,
                                             seed=3), 20_001))
    even = gaps(send_offsets(ArrivalConfig(rate=10.0, process="gamma", burstiness=4.0,
                                           seed=3), 20_001))
    for g in (bursty, even):
        assert g.mean() == pytest.approx(0.1, rel=0.05)
    # CV of a gamma with shape k is 1/sqrt(k).
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.06)
    assert even.std() / even.mean() == pytest.approx(0.5, rel=0.06)


def test_constant_rate_is_evenly_spaced() -> None:
    off = send_offsets(ArrivalConfig(rate=4.0, process="constant"), 5)
    assert off == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_the_seed_fixes_the_schedule() -> None:
    a = send_offsets(ArrivalConfig(rate=3.0, seed=11), 50)
    assert np.array_equal(a, send_offsets(ArrivalConfig(rate=3.0, seed=11), 50))
    assert not np.array_equal(a, send_offsets(ArrivalConfig(rate=3.0, seed=12), 50))


def test_duration_cuts_the_schedule() -> None:
    off = send_offsets(ArrivalConfig(rate=20.0, duration_s=10.0, seed=0), 10_000)
    assert off.max() < 10.0
    assert len(off) == pytest.approx(200, rel=0.15)


def test_linear_ramp_from_zero_follows_the_integrated_rate() -> None:
    # Rate 0 -> 10/s over 10 s: Lambda(t) = t^2 / 2, so arrival k is at sqrt(2k); after
    # the ramp (Lambda = 50) arrivals are 0.1 s apart.
    cfg = ArrivalConfig(rate=10.0, process="constant", ramp_from=0.0, ramp_s=10.0)
    off = send_offsets(cfg, 61)
    assert off[8] == pytest.approx(4.0)
    assert off[50] == pytest.approx(10.0)
    assert np.diff(off[50:]) == pytest.approx(np.full(10, 0.1))


def test_ramp_down_keeps_the_schedule_ordered() -> None:
    cfg = ArrivalConfig(rate=1.0, process="constant", ramp_from=9.0, ramp_s=2.0)
    off = send_offsets(cfg, 20)
    assert np.all(np.diff(off) > 0)
    # Lambda(2) = 9*2 - 8*4/4 = 10 arrivals in the ramp, then one per second.
    assert off[10] == pytest.approx(2.0)
    assert off[11] == pytest.approx(3.0)


def test_warmup_by_count_or_time() -> None:
    cfg = ArrivalConfig(warmup_requests=2, warmup_s=1.0)
    assert cfg.is_warmup(1, 5.0) and cfg.is_warmup(3, 0.5)
    assert not cfg.is_warmup(2, 1.0)


@pytest.mark.parametrize("kwargs", [
    {"rate": 0.0}, {"rate": -1.0}, {"process": "uniform"}, {"burstiness": 0.0},
    {"max_concurrency": 0}, {"duration_s": 0.0}, {"ramp_from": 1.0},
    {"rate": math.inf, "ramp_from": 1.0, "ramp_s": 1.0},
])
def test_bad_configs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ArrivalConfig(**kwargs)  # type: ignore[arg-type]
