"""Plots of the planner: predicted goodput vs rate, predicted vs measured (parity), and
colocated vs disaggregated over fleet sizes. matplotlib is imported only here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.plan.predict import Prediction


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def goodput_vs_rate(predictions: Sequence[Prediction], path: Path, title: str) -> Path:
    """Predicted goodput against the request rate, one line per configuration."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    names = list(dict.fromkeys(p.config for p in predictions))
    for name in names:
        mine = sorted((p for p in predictions if p.config == name), key=lambda p: p.rate)
        style = "-" if name.startswith("colocated") else "--"
        ax.plot([p.rate for p in mine], [p.summary["goodput"] for p in mine], style,
                marker="o", label=name)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("predicted goodput (req/s within the SLOs)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, path)


def parity(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Predicted against measured, one panel per metric; rows carry metric, config,
    predicted and measured."""
    plt = _plt()
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3.8))
    axes = axes if len(metrics) > 1 else [axes]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    markers = "osD^v<>"
    for ax, metric in zip(axes, metrics, strict=True):
        mine = [r for r in rows if r["metric"] == metric]
        top = max([max(r["predicted"], r["measured"]) for r in mine] + [1e-3]) * 1.1
        ax.plot([0, top], [0, top], color="grey", lw=0.8)
        ax.fill_between([0, top], [0, top * 0.9], [0, top * 1.1], color="grey", alpha=0.15)
        for k, config in enumerate(configs):
            pts = [r for r in mine if r["config"] == config]
            ax.scatter([r["measured"] for r in pts], [r["predicted"] for r in pts],
                       marker=markers[k % len(markers)], label=config)
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)


def crossover(series: dict[str, dict[str, list[tuple[int, float]]]], path: Path,
              title: str) -> Path:
    """Per workload (one panel each): best goodput per GPU against the fleet size, one
    line per family of configurations."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4.2))
    axes = axes if len(series) > 1 else [axes]
    for ax, (workload, lines) in zip(axes, series.items(), strict=True):
        for family, points in lines.items():
            ax.plot([g for g, _ in points], [v for _, v in points], marker="o", label=family)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("simulated goodput per GPU (req/s)")
        ax.set_title(workload, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)
