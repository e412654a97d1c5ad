"""PNG plots of benchmark runs, drawn with matplotlib's object API on the Agg canvas.

``Figure`` objects are used directly (no pyplot), so plotting needs no display, keeps no
global state and leaks no figures across a sweep. Each function draws one file and
returns its path, or None when there is nothing to draw (e.g. a rate plot of one rate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from services.traffic.latency import ANATOMY_SEGMENTS, itls, tpot
from services.traffic.record import RequestRecord

LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL (per chunk gap)"),
             ("e2e_s", "E2E"))


def _samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    ok = [r for r in records if r.ok and not r.warmup]
    return {
        "ttft_s": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot_s": [t for r in ok if (t := tpot(r)) is not None],
        "itl_s": [g for r in ok for g in itls(r)],
        "e2e_s": [r.e2e_s for r in ok if r.e2e_s is not None],
    }


def latency_cdfs(runs: Sequence[tuple[str, Sequence[RequestRecord]]], path: Path) -> Path:
    """CDFs of TTFT, TPOT, ITL and E2E; one line per run (runs side by side)."""
    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    samples = [(label, _samples(records)) for label, records in runs]
    for ax, (key, title) in zip(axes, LATENCIES, strict=True):
        for label, values in samples:
            data = np.sort(np.asarray(values[key]))
            if data.size:
                ax.step(data, np.arange(1, data.size + 1) / data.size, where="post", label=label)
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("share of samples")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def _finite(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    runs = [s for s in summaries if s.get("rate") is not None and math.isfinite(s["rate"])]
    return sorted(runs, key=lambda s: s["rate"])


def _value(summary: dict[str, Any], metric: str, stat: str) -> float:
    value = summary[metric][stat]
    return float("nan") if value is None else float(value)


def latency_vs_rate(summaries: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """TTFT and TPOT (p50, p99) against the offered request rate."""
    runs = _finite(summaries)
    if len(runs) < 2:
        return None
    rates = [s["rate"] for s in runs]
    fig = Figure(figsize=(11, 4), layout="constrained")
    pairs = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"))
    for ax, (metric, title) in zip(fig.subplots(1, 2), pairs, strict=True):
        for stat in ("p50", "p99"):
            ax.plot(rates, [_value(s, metric, stat) for s in runs], marker="o", label=stat)
        bound = runs[0].get("slos", {}).get(metric.removesuffix("_s"))
        if bound is not None:
            ax.axhline(bound, color="red", linestyle="--", label="SLO")
        ax.set_title(f"{title} vs request rate")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def goodput_vs_rate(summaries: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Goodput (all SLOs met) and completed throughput against the offered rate."""
    runs = _finite(summaries)
    if len(runs) < 2:
        return None
    rates = [s["rate"] for s in runs]
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    ax.plot(rates, rates, color="grey", linestyle=":", label="offered")
    ax.plot(rates, [s["request_throughput"] for s in runs], marker="o", label="completed")
    ax.plot(rates, [s["goodput"] for s in runs], marker="s", label="goodput (all SLOs)")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("requests/s")
    ax.set_title("Goodput vs request rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def anatomy_bars(summaries: Sequence[tuple[str, dict[str, Any]]], path: Path) -> Path | None:
    """Stacked bars of the mean time per anatomy segment, one bar per run."""
    runs = [(label, s["anatomy"]) for label, s in summaries if s.get("anatomy")]
    if not runs:
        return None
    fig = Figure(figsize=(max(6.0, 1.3 * len(runs) + 4), 5), layout="constrained")
    ax = fig.subplots()
    bottoms = np.zeros(len(runs))
    for seg in ANATOMY_SEGMENTS:
        # Signed residuals can dip below 0 on a skewed clock; a bar cannot.
        heights = np.array([max(0.0, a[seg]["mean"] or 0.0) for _, a in runs])
        if heights.any():
            ax.bar([label for label, _ in runs], heights, bottom=bottoms, label=seg)
        bottoms += heights
    ax.set_ylabel("mean seconds per request")
    ax.set_title("Where a request's time went (server timings)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelrotation=20)
    fig.savefig(path, dpi=100)
    return path


def side_by_side(a: tuple[str, dict[str, Any]], b: tuple[str, dict[str, Any]],
                 path: Path) -> Path:
    """p50 and p99 of each latency for two runs, as grouped bars."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    width = 0.38
    for ax, (metric, title) in zip(fig.subplots(1, 4), LATENCIES, strict=True):
        x = np.arange(2)
        for k, (label, summary) in enumerate((a, b)):
            values = [_value(summary, metric, "p50"), _value(summary, metric, "p99")]
            ax.bar(x + (k - 0.5) * width, values, width, label=label)
        ax.set_xticks(x, ["p50", "p99"])
        ax.set_title(title)
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3, axis="y")
    fig.axes[0].legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path
