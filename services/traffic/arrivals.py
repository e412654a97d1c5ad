"""When requests are sent: arrival processes, ramps, warm-up and limits.

The schedule is computed up front as offsets from the run's start, so it is exact,
seeded, testable without a clock, and the same for every target. Gaps between arrivals
are gamma distributed with mean 1/rate and shape ``burstiness`` (1 is Poisson, below 1
burstier, above 1 more even), as in ``vllm bench serve``; ``constant`` spaces them
evenly. A linear ramp changes the rate over time by a time change of the unit-rate
process, which keeps the process exact (no per-step rate approximation). A replayed trace
(process ``trace``) brings its own send times with its requests (``RequestSpec.at_s``);
``rate`` then only records its mean rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.traffic.request import RequestSpec

PROCESSES = ("poisson", "gamma", "constant")
TRACE = "trace"  # the send times come with the requests: a replayed trace


@dataclass(slots=True, frozen=True)
class ArrivalConfig:
    rate: float = math.inf  # requests/s at full speed; inf sends everything at once
    process: str = "poisson"  # poisson | gamma | constant
    burstiness: float = 1.0  # gamma shape (poisson forces 1)
    ramp_from: float | None = None  # start rate of a linear ramp up (or down) to ``rate``
    ramp_s: float = 0.0  # ramp length in seconds
    max_concurrency: int | None = None  # at most this many requests in flight
    duration_s: float | None = None  # send nothing after this; the run ends at it (+drain)
    warmup_requests: int = 0  # the first N requests are left out of the metrics
    warmup_s: float = 0.0  # requests sent in the first S seconds are left out too
    seed: int = 0

    def __post_init__(self) -> None:
        if self.process not in (*PROCESSES, TRACE):
            raise ValueError(f"unknown arrival process {self.process!r}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be > 0")
        if self.ramp_from is not None:
            if math.isinf(self.rate) or self.ramp_from < 0 or math.isinf(self.ramp_from):
                raise ValueError("a ramp needs finite rates (ramp_from >= 0, rate > 0)")
            if self.ramp_s <= 0:
                raise ValueError("a ramp needs ramp_s > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be > 0")

    def is_warmup(self, index: int, offset_s: float) -> bool:
        return index < self.warmup_requests or offset_s < self.warmup_s


def _unit_gaps(cfg: ArrivalConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    """n gaps of a unit-rate process (mean 1)."""
    if cfg.process == "constant":
        return np.ones(n)
    shape = 1.0 if cfg.process == "poisson" else cfg.burstiness
    return rng.gamma(shape, 1.0 / shape, size=n)


def _invert_ramp(work: np.ndarray, r0: float, r1: float, ramp_s: float) -> np.ndarray:
    """Times t at which the integrated rate Lambda(t) reaches ``work``.

    Lambda(t) = r0*t + (r1-r0)*t^2/(2*ramp_s) during the ramp, then grows at r1. The
    root is written as 2L / (b + sqrt(b^2 + 4aL)) so a flat ramp (a = 0) needs no case.
    """
    a = (r1 - r0) / (2 * ramp_s)
    at_end = r0 * ramp_s + a * ramp_s**2
    inside = work <= at_end
    times = np.empty_like(work)
    w = work[inside]
    root = r0 + np.sqrt(np.maximum(r0**2 + 4 * a * w, 0.0))
    times[inside] = np.divide(2 * w, root, out=np.zeros_like(w), where=root > 0)
    times[~inside] = ramp_s + (work[~inside] - at_end) / r1
    return times


def send_offsets(cfg: ArrivalConfig, n: int) -> np.ndarray:
    """Send times of up to ``n`` requests, seconds after the start; the first is at 0.

    Fewer than n come back when ``duration_s`` cuts the schedule short.
    """
    if n <= 0:
        return np.zeros(0)
    if math.isinf(cfg.rate):
        offsets = np.zeros(n)
    else:
        rng = np.random.default_rng(cfg.seed)
        work = np.concatenate([[0.0], np.cumsum(_unit_gaps(cfg, n - 1, rng))])
        if cfg.ramp_from is None:
            offsets = work / cfg.rate
        else:
            offsets = _invert_ramp(work, cfg.ramp_from, cfg.rate, cfg.ramp_s)
    if cfg.duration_s is not None:
        offsets = offsets[offsets < cfg.duration_s]
    return offsets


def schedule(cfg: ArrivalConfig, specs: Sequence[RequestSpec], n: int) -> np.ndarray:
    """Send times of up to ``n`` requests: ``send_offsets``, or for a replayed trace the
    requests' own times (at most one per spec), cut at ``duration_s`` as well."""
    if cfg.process != TRACE:
        return send_offsets(cfg, n)
    times = [spec.at_s for spec in specs[:n]]
    if any(t is None for t in times):
        raise ValueError("trace arrivals need every request's send time (at_s)")
    offsets = np.asarray(times, dtype=float)
    if cfg.duration_s is not None:
        offsets = offsets[offsets < cfg.duration_s]
    return offsets
