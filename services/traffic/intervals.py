"""Numbers with their uncertainty: a metric measured in N repeated runs, reported as the
median of the runs with a confidence interval.

Two interval methods, both over the N per-run values (each run is one sample; the
requests inside a run are not independent samples of the run-to-run noise):

- ``t`` (the default, as AIPerf's multi-run reports): Student's t interval on the mean,
  mean +- t(level, N-1) * s / sqrt(N). Assumes roughly normal run-to-run noise; needs
  N >= 2.
- ``order``: the distribution-free interval of the median from order statistics: the
  k-th smallest and k-th largest run, with the largest k whose binomial coverage
  1 - 2 * P(Binomial(N, 1/2) < k) is at least the level. With few runs no k reaches the
  level (N = 5 covers at most 94%); the interval is then the smallest to the largest run
  and ``coverage`` says what it really covers.

No SciPy: the t quantile comes from the regularized incomplete beta function
(a continued fraction) and bisection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

METHODS = ("t", "order")
METHOD_NAMES = {
    "t": "Student's t interval on the mean of the runs",
    "order": "order-statistic (binomial) interval on the median of the runs",
}


@dataclass(frozen=True, slots=True)
class Interval:
    median: float
    low: float
    high: float
    mean: float
    std: float  # sample std (ddof 1) over the runs; 0 for one run
    n: int  # runs
    level: float  # the confidence level asked for
    coverage: float  # what the interval covers (below ``level`` when N is too small)
    method: str

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Interval:
        return cls(**{f.name: data[f.name] for f in fields(cls)})


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom (0 < p < 1)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return (low + high) / 2.0


def binomial_cdf(k: int, n: int, p: float = 0.5) -> float:
    """P(Binomial(n, p) <= k)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, k + 1))


def median_order_interval(sorted_values: Sequence[float], level: float,
                          ) -> tuple[float, float, float]:
    """(low, high, coverage) of the order-statistic interval of the median."""
    n = len(sorted_values)
    best = 1
    for k in range(1, n // 2 + 1):
        if 1.0 - 2.0 * binomial_cdf(k - 1, n) >= level:
            best = k
    coverage = 1.0 - 2.0 * binomial_cdf(best - 1, n)
    return float(sorted_values[best - 1]), float(sorted_values[n - best]), coverage


def interval(values: Sequence[float], level: float = 0.95, method: str = "t") -> Interval:
    """The median of ``values`` (one per run) with a ``level`` confidence interval."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"the confidence level must be between 0 and 1, got {level}")
    if method not in METHODS:
        raise ValueError(f"unknown interval method {method!r}; choose from {METHODS}")
    arr = np.sort(np.asarray(values, dtype=float))
    if arr.size == 0:
        raise ValueError("an interval needs at least one value")
    n = int(arr.size)
    median, mean = float(np.median(arr)), float(arr.mean())
    std = float(arr.std(ddof=1)) if n > 1 else 0.0
    if n == 1:
        low = high = mean
        coverage = 0.0
    elif method == "t":
        half = t_quantile(0.5 + level / 2.0, n - 1) * std / math.sqrt(n)
        low, high, coverage = mean - half, mean + half, level
    else:
        low, high, coverage = median_order_interval(arr.tolist(), level)
    return Interval(median, low, high, mean, std, n, level, coverage, method)


def describe(method: str, level: float) -> str:
    """One line naming the interval, for reports."""
    return f"{level:.0%} {METHOD_NAMES[method]}"
