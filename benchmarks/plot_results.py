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
    names = list(results)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="bench-results", help="folder of the JSON results")
    parser.add_argument("--out", default="docs/benchmarks", help="where the PNGs go")
    args = parser.parse_args()
    results, out = Path(args.results), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, plot in (("api_overhead", api_overhead), ("kv_transport", kv_transport),
                       ("disagg_ttft", disagg_ttft), ("router_overhead", router)):
        data = load(results, name)
        if data is None:
            print(f"skipped {name}: no {results}/{name}.json")
            continue
        plot(data, out)
        print(f"wrote {out}/{name}.png")


if __name__ == "__main__":
    main()
