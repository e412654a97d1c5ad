"""Plots for BENCHMARKS.md from the benchmarks' JSON results.

    python benchmarks/plot_results.py --results bench-results --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def api_overhead(data: dict[str, Any], out: Path) -> None:
    rows = data["rows"]
    labels = list(rows)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [rows[k]["ttft_ratio"] for k in labels], 0.4, label="TTFT")
    ax.bar([i + 0.2 for i in x], [rows[k]["tpot_ratio"] for k in labels], 0.4, label="TPOT")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.05, color="red", lw=0.8, ls="--", label="goal: +5%")
    ax.set_xticks(list(x), [f"{k} prompt tokens" for k in labels])
    ax.set_ylabel("through gRPC / in-process")
    ax.set_ylim(0.8, 1.2)
    ax.set_title("API layer overhead (median of alternating rounds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "api_overhead.png", dpi=120)


def kv_transport(data: dict[str, Any], out: Path) -> None:
    results = data["results"]
    names = [n for n in results if "gb_per_s" in results[n]]  # not the checksum table
    values = [results[n]["gb_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh(names, values, color=["grey"] + ["tab:blue"] * (len(names) - 1))
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.2f} GB/s", va="center", fontsize=8)
    ax.set_xlabel("GB/s (46 MB of KV, two processes on loopback)")
    ax.set_title("KV transfer vs one-thread memcpy")
    fig.tight_layout()
    fig.savefig(out / "kv_transport.png", dpi=120)


def disagg_ttft(data: dict[str, Any], out: Path) -> None:
    med = data["ttft_median_s"]
    labels = {"colocated_all_cores": "colocated\n2 cores", "colocated_one_core":
              "colocated\n1 core", "disaggregated": "disaggregated\nP: core 0, D: core 1"}
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([labels[k] for k in med], [med[k] for k in med],
           color=["tab:grey", "tab:grey", "tab:blue"])
    hidden = data["kv_transfer_hidden_s_median"]
    exposed = data["kv_transfer_s_median"] - hidden
    ax.set_ylabel("TTFT, median (s)")
    ax.set_title(f"TTFT at {data['prompt_tokens']} prompt tokens; KV transfer "
                 f"{data['kv_transfer_s_median']:.2f} s, exposed {exposed:.2f} s", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "disagg_ttft.png", dpi=120)


def router(data: dict[str, Any], out: Path) -> None:
    lat = data["latency"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = ["TTFT p50", "TTFT p99", "E2E p50", "E2E p99"]
    keys = ["ttft_added_p50_ms", "ttft_added_p99_ms", "e2e_added_p50_ms", "e2e_added_p99_ms"]
    ax.bar(names, [lat[k] for k in keys])
    ax.axhline(2.0, color="red", lw=0.8, ls="--", label="goal: 2 ms at p99")
    ax.set_ylabel("ms added by the router")
    ax.set_title("Router latency over calling the (simulated) worker directly")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "router_overhead.png", dpi=120)


def security_overhead(data: dict[str, Any], out: Path) -> None:
    """The router with each security mode: added TTFT (p50) and capacity per core."""
    modes = [m for m in data if m != "ratios"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    added = [data[m]["latency"]["ttft_added_p50_ms"] for m in modes]
    axes[0].bar(modes, added, color="tab:blue")
    axes[0].set_ylabel("TTFT added by the router, p50 (ms)")
    base = data[modes[0]]["capacity_short"]["requests_per_router_core_s"]
    per_core = [data[m]["capacity_short"]["requests_per_router_core_s"] / base for m in modes]
    axes[1].bar(modes, per_core, color="tab:orange")
    axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[1].set_ylabel(f"routed requests/s per core, vs {modes[0]}")
    fig.suptitle("Router with API keys, TLS, and mTLS to the workers (simulated workers)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "security_overhead.png", dpi=120)


def stack_overhead(data: dict[str, Any], out: Path) -> None:
    """TTFT and TPOT of each pdserve front, relative to plain vLLM, per prompt length."""
    med = data["median"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        lengths = list(med)
        names = [n for n in med[lengths[0]] if n != "vllm"]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ratios = [med[n][name][metric] / med[n]["vllm"][metric] for n in lengths]
            ax.bar([k + i * width for k in range(len(lengths))], ratios, width, label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([k + width * (len(names) - 1) / 2 for k in range(len(lengths))],
                      [f"{n} prompt tokens" for n in lengths])
        ax.set_title(f"{metric.upper()} / plain vLLM (median, one request at a time)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "stack_overhead.png", dpi=110)


HEADLINE_SEGMENTS = ("prefill_queue", "prefill", "kv_transfer", "decode_queue", "decode")


def headline(data: dict[str, Any], out: Path, anatomy_rate: float = 1.0) -> None:
    """Tails and goodput vs rate per configuration; where the time went at one rate."""
    configs = data["configs"]
    slo = data["args"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("ttft_p99", "TTFT p99 (s)", slo["ttft_slo"]),
              ("tpot_p99", "TPOT p99 (s)", slo["tpot_slo"]),
              ("itl_p99", "ITL p99 (s)", slo["itl_slo"])]
    for ax, (key, title, bound) in zip(axes.flat, panels, strict=False):
        for name, rows in configs.items():
            ax.plot([r["rate"] for r in rows], [r[key] for r in rows], marker="o", label=name)
        ax.axhline(bound, color="red", lw=0.8, ls="--", label="SLO")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("requests/s")
    ax = axes.flat[3]
    for i, (name, rows) in enumerate(configs.items()):
        color = f"C{i}"
        rates = [r["rate"] for r in rows]
        ax.plot(rates, [r["goodput_per_request"] for r in rows], marker="o", color=color,
                label=f"{name}: TTFT+TPOT SLO")
        ax.plot(rates, [r["goodput_per_token"] for r in rows], marker="x", ls=":",
                color=color, label=f"{name}: ITL SLO")
    ax.set_title("goodput (requests/s meeting the SLOs)")
    ax.set_xlabel("requests/s")
    axes.flat[0].legend(fontsize=7)
    ax.legend(fontsize=6)
    fig.suptitle(f"mixed workload (share {slo['long_share']:g} of 1800-token prompts), "
                 "2 cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "headline.png", dpi=110)

    # anatomy: mean seconds per segment, chat and long requests, at the middle rate
    names = list(configs)
    rates = [r["rate"] for r in configs[names[0]]]
    mid = min(range(len(rates)), key=lambda i: abs(rates[i] - anatomy_rate))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, kind in zip(axes, ("chat", "long"), strict=True):
        bottoms = [0.0] * len(names)
        for seg in HEADLINE_SEGMENTS:
            heights = [(configs[n][mid]["anatomy"].get(kind) or {}).get(seg) or 0.0
                       for n in names]
            heights = [max(0.0, h) for h in heights]
            ax.barh(names, heights, left=bottoms, label=seg)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        ax.set_title(f"{kind} requests at {configs[names[0]][mid]['rate']:g} req/s: "
                     "mean seconds")
        ax.invert_yaxis()
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out / "headline_anatomy.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="bench-results", help="folder of the JSON results")
    parser.add_argument("--out", default="docs/benchmarks", help="where the PNGs go")
    parser.add_argument("--anatomy-rate", type=float, default=1.0,
                        help="headline: the request rate whose anatomy is drawn")
    args = parser.parse_args()
    results, out = Path(args.results), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, plot in (("api_overhead", api_overhead), ("kv_transport", kv_transport),
                       ("disagg_ttft", disagg_ttft), ("router_overhead", router),
                       ("headline", headline), ("stack_overhead", stack_overhead),
                       ("security_overhead", security_overhead)):
        data = load(results, name)
        if data is None:
            print(f"skipped {name}: no {results}/{name}.json")
            continue
        if plot is headline:
            headline(data, out, args.anatomy_rate)
        else:
            plot(data, out)
        print(f"wrote {out}/{name}.png")


if __name__ == "__main__":
    main()
