"""`pdserve up --planner-profile`: the P:D split of a running GPU stack, chosen from the
traffic it serves.

Every `interval_s` the launcher reads what the decode pool finished since its last look:
vLLM's `vllm:request_prompt_tokens` and `vllm:request_generation_tokens` histograms on
each decode worker (every request ends on one, whether its prompt was shipped or
prefilled there; a shipped one counts the prefill worker's first token with its prompt,
one token off, which the planner leaves as it is). It replays that traffic on the
simulator of `pdserve plan predict` (Poisson arrivals at the observed rate; lengths
drawn from the histograms' buckets and scaled to their observed means) on each split of
the stack's workers between the pools that keeps both at their floors, and moves to the
split with the most goodput under the SLOs when that beats the current split by more
than `margin` (the planner's own error against real runs: a smaller gain is noise and
would move workers back and forth), at most once per `cooldown_s`. The total stays what
`pdserve up --prefill/--decode` or `pdserve scale` set; the planner only moves workers
from one pool to the other.

On CPU cores the pools are core sets fixed at start (every worker of a role shares that
role's cores), so moving a worker between pools changes nothing the model describes:
a profile measured on cores is refused, with the advice to start the stack with
`pdserve plan predict`'s flags instead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from services.plan.configs import spread
from services.plan.costmodel import Profile
from services.plan.fleet import FleetConfig, PoolSpec, SimRequest
from services.plan.predict import CLOSE_CALL, simulate
from services.traffic.arrivals import ArrivalConfig, send_offsets
from services.traffic.slo import SLOs

log = logging.getLogger(__name__)

PROMPT = "vllm:request_prompt_tokens"
OUTPUT = "vllm:request_generation_tokens"
DRAIN_S = 60.0  # simulated time after the last arrival for the requests in flight to end
RESIZES = Counter("pdserve_planner_resizes", "P:D splits changed by the live planner")


class PlannerError(ValueError):
    """A planner setting or profile that cannot work; the message says what to do."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """A Prometheus histogram summed over its label sets: the observations, their sum,
    and the cumulative count at each upper bound (ascending, +inf last)."""

    count: float = 0.0
    total: float = 0.0
    buckets: tuple[tuple[float, float], ...] = ()

    def minus(self, before: Histogram) -> Histogram | None:
        """What was observed since `before`; None when a counter went back (a restart)."""
        if self.count < before.count or self.total < before.total:
            return None
        old = dict(before.buckets)
        buckets = tuple((le, n - old.get(le, 0.0)) for le, n in self.buckets)
        if any(n < 0 for _, n in buckets):
            return None
        return Histogram(self.count - before.count, self.total - before.total, buckets)

    def plus(self, other: Histogram) -> Histogram:
        counts = dict(self.buckets)
        for le, n in other.buckets:
            counts[le] = counts.get(le, 0.0) + n
        return Histogram(self.count + other.count, self.total + other.total,
                         tuple(sorted(counts.items())))

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


def read_histograms(text: str, names: tuple[str, ...] = (PROMPT, OUTPUT)) -> dict[str, Histogram]:
    """The histograms `names` of one Prometheus text page (absent ones left out)."""
    out: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in names:
            continue
        count = total = 0.0
        per_le: dict[float, float] = {}
        for sample in family.samples:
            if sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                per_le[le] = per_le.get(le, 0.0) + sample.value
        out[family.name] = Histogram(count, total, tuple(sorted(per_le.items())))
    return out


@dataclass(frozen=True, slots=True)
class Traffic:
    """What the decode pool finished in a window of `seconds`."""

    seconds: float
    prompt: Histogram
    output: Histogram

    @property
    def requests(self) -> int:
        return int(self.prompt.count)

    @property
    def rate(self) -> float:
        return self.prompt.count / self.seconds if self.seconds > 0 else 0.0


@dataclass
class TrafficMeter:
    """Turns successive scrapes of the decode workers into windows of traffic. A worker
    seen for the first time, or with a new restart epoch, starts counting from its next
    scrape (its counters started again)."""

    last: dict[str, tuple[int, dict[str, Histogram]]] = field(default_factory=dict)
    last_at: float | None = None

    def window(self, pages: Mapping[str, tuple[int, str | None]], now: float) -> Traffic | None:
        """`pages`: worker id -> (epoch, its metrics page, None if unreadable). The
        traffic since the previous call; None on the first call."""
        prompt, output = Histogram(), Histogram()
        seen: dict[str, tuple[int, dict[str, Histogram]]] = {}
        for worker, (epoch, text) in pages.items():
            if text is None:
                continue
            hists = read_histograms(text)
            seen[worker] = (epoch, hists)
            before = self.last.get(worker)
            if before is None or before[0] != epoch:
                continue
            d_prompt = _delta(hists, before[1], PROMPT)
            d_output = _delta(hists, before[1], OUTPUT)
            if d_prompt is not None and d_output is not None:
                prompt, output = prompt.plus(d_prompt), output.plus(d_output)
        started, self.last, self.last_at = self.last_at, seen, now
        if started is None:
            return None
        return Traffic(now - started, prompt, output)


def _delta(now: dict[str, Histogram], before: dict[str, Histogram],
           name: str) -> Histogram | None:
    return now.get(name, Histogram()).minus(before.get(name, Histogram()))


def draw_lengths(h: Histogram, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` token counts distributed like `h`: uniform within each bucket, then scaled so
    their mean is the observed one (buckets are coarse; the mean is exact)."""
    lows, highs, weights = [], [], []
    low, cum = 0.0, 0.0
    for le, total in h.buckets:
        if total > cum:
            high = le if math.isfinite(le) else max(2 * low, h.mean, 1.0)
            lows.append(low)
            highs.append(max(high, low + 1))
            weights.append(total - cum)
        low, cum = (le if math.isfinite(le) else low), max(cum, total)
    if not weights:
        return np.full(n, max(1.0, round(h.mean)))
    p = np.asarray(weights) / sum(weights)
    pick = rng.choice(len(weights), size=n, p=p)
    values = rng.uniform(np.asarray(lows)[pick], np.asarray(highs)[pick])
    if h.mean > 0 and values.mean() > 0:
        values *= h.mean / values.mean()
    return np.maximum(1.0, np.round(values))


@dataclass(frozen=True)
class PlannerSettings:
    slos: SLOs
    interval_s: float = 60.0
    cooldown_s: float = 300.0
    min_prefill: int = 1
    min_decode: int = 1
    margin: float = CLOSE_CALL
    min_requests: int = 30  # fewer finished in a window: too little to judge by
    horizon_s: float = 120.0  # simulated seconds of the observed traffic
    max_candidates: int = 8  # splits simulated per decision (spread, plus the current one)


@dataclass(frozen=True)
class Decision:
    current: tuple[int, int]  # (prefill, decode)
    chosen: tuple[int, int]
    action: Literal["resize", "keep", "wait", "idle"]  # wait: cool-down; idle: too little
    reason: str
    goodput: dict[tuple[int, int], float] = field(default_factory=dict)


class LivePlanner:
    """Chooses the split for each window of traffic; remembers when it last changed it."""

    def __init__(self, profile: Profile, settings: PlannerSettings, engine_units: int = 1,
                 transport: str = "grpc", local_prefill_max_tokens: int = 0,
                 seed: int = 0) -> None:
        if profile.unit != "gpu":
            raise PlannerError(
                "the live planner moves GPU workers between the pools; this profile was "
                f"measured on {profile.unit}s, where each pool is a core set fixed at start: "
                "run `pdserve plan predict` and start the stack with the flags it prints")
        if settings.min_decode < 1 or settings.min_prefill < 0:
            raise PlannerError("planner floors: decode >= 1, prefill >= 0")
        self.profile, self.settings = profile, settings
        self.engine_units, self.transport = engine_units, transport
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.seed = seed
        self.changed_at: float | None = None

    def candidates(self, current: tuple[int, int]) -> list[tuple[int, int]]:
        """Splits of the current total within the floors: evenly spread, and the current
        one with its neighbours."""
        s, total = self.settings, sum(current)
        lo, hi = s.min_prefill, total - s.min_decode
        if hi < lo:
            return [current]
        ps = spread(list(range(lo, hi + 1)), s.max_candidates)
        near = [p for p in (current[0] - 1, current[0], current[0] + 1) if lo <= p <= hi]
        return [(p, total - p) for p in sorted(set(ps) | set(near))]

    def config(self, split: tuple[int, int]) -> FleetConfig:
        p, d = split
        return FleetConfig(f"{p}p{d}d", PoolSpec(d, self.engine_units),
                           PoolSpec(p, self.engine_units) if p else None,
                           local_prefill_max_tokens=self.local_prefill_max_tokens,
                           transport=self.transport)

    def replay(self, traffic: Traffic) -> tuple[list[SimRequest], list[bool]]:
        """The observed traffic as a seeded schedule of `horizon_s` seconds."""
        arrivals = ArrivalConfig(rate=traffic.rate, duration_s=self.settings.horizon_s,
                                 seed=self.seed)
        offsets = send_offsets(arrivals, max(1, math.ceil(traffic.rate
                                                          * self.settings.horizon_s * 2)))
        rng = np.random.default_rng(self.seed)
        n = len(offsets)
        prompts = draw_lengths(traffic.prompt, n, rng)
        outputs = draw_lengths(traffic.output, n, rng)
        requests = [SimRequest(float(t), int(pl), int(ol))
                    for t, pl, ol in zip(offsets.tolist(), prompts, outputs, strict=True)]
        return requests, [False] * n

    def decide(self, traffic: Traffic | None, current: tuple[int, int],
               now: float) -> Decision:
        s = self.settings
        if traffic is None or traffic.requests < s.min_requests:
            got = 0 if traffic is None else traffic.requests
            return Decision(current, current, "idle",
                            f"{got} requests finished in the window; {s.min_requests} needed")
        if self.changed_at is not None and now - self.changed_at < s.cooldown_s:
            left = s.cooldown_s - (now - self.changed_at)
            return Decision(current, current, "wait", f"cooling down for {left:.0f} s more")
        requests, warmup = self.replay(traffic)
        horizon = s.horizon_s + DRAIN_S
        goodput = {split: simulate(self.config(split), self.profile, requests, warmup,
                                   traffic.rate, horizon, s.slos).summary["goodput"]
                   for split in self.candidates(current)}
        best = max(goodput, key=lambda k: (goodput[k], k == current, -k[0]))
        mine = goodput.get(current, 0.0)
        what = (f"{traffic.rate:.2f} req/s, {traffic.prompt.mean:.0f} prompt and "
                f"{traffic.output.mean:.0f} output tokens on average; predicted goodput "
                + ", ".join(f"{p}p{d}d {g:.2f}/s" for (p, d), g in sorted(goodput.items())))
        if best == current or goodput[best] <= mine * (1 + s.margin):
            return Decision(current, current, "keep", what, goodput)
        self.changed_at = now
        RESIZES.inc()
        return Decision(current, best, "resize", what, goodput)

