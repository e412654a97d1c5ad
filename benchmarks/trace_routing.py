"""Replaying production traffic through `pdserve up` under each routing mode: what the
router's prefix index saves in prefill compute and KV transfer, and what that does to
TTFT, on the same machine in one run.

Each configuration is a `pdserve up` stack of its own (prefill and decode workers as
given), started alone and replayed the same trace window with `pdserve bench run
--trace` (the same seeds, so the same prompts, arrivals and turn order):
  * round_robin: pairs in turn, no prefix index (the baseline);
  * approximate: the load policy on the Redis prefix index (which prefill worker was
    sent a prompt's blocks; decode caches invisible), KV events off;
  * precise: the load policy on the engines' own KV events (both pools' caches), and
    the decode worker's cached prefix left out of the transfer;
  * conditional: precise, and prompts up to `--local-prefill-max-tokens` tokens left to
    the decode worker (conditional disaggregation).
Reported per configuration, from the workers' own counters: prompt tokens the engines
computed (vLLM's `prompt_tokens_by_source{source="local_compute"}`, both pools: neither the
tokens found in a prefix cache nor those whose KV was shipped in), KV bytes shipped and
what shipping every block would have moved; from the replay: TTFT p50/p99, TPOT p50 and
goodput under the stated SLOs.

    python benchmarks/trace_routing.py --trace ../shared/traces/mooncake_conversation.jsonl \\
        --conversations 8 --trace-rate 0.3 --json bench-results/trace_routing.json \\
        --plot docs/benchmarks/trace_routing.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS: dict[str, list[str]] = {
    "round_robin": ["--policy", "round_robin", "--no-kv-events"],
    "approximate": ["--no-kv-events"],
    "precise": [],
    "conditional": ["--local-prefill-max-tokens", "256"],
}
COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"
DECODE = ("pdserve_kv_transfer_bytes_total", "pdserve_kv_prompt_bytes_total",
          "pdserve_kv_reused_prefix_tokens_total", "pdserve_kv_reuse_fallbacks_total")


def scrape(address: str) -> dict[str, float]:
    """Counter totals of one worker's /metrics, summed over their label sets except
    `source` (vLLM's prompt tokens by where they came from: computed, cached, shipped)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name + (f"{{source={s.labels['source']}}}" if "source" in s.labels
                             else "")
            totals[name] = totals.get(name, 0.0) + s.value
    return totals


async def counters(stack: Any) -> dict[str, dict[str, float]]:
    """Per worker id: its role's counters."""
    out: dict[str, dict[str, float]] = {}
    for w in await stack.records():
        metrics = scrape(w.metrics_address)
        names = (COMPUTED, *(DECODE if w.role == "decode" else ()))
        out[w.worker_id] = {"role_decode": float(w.role == "decode"),
                            **{n: metrics.get(n, 0.0) for n in names}}
    return out


def deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
           ) -> dict[str, float]:
    """The run's totals: engines' computed prompt tokens per pool, KV bytes."""
    out = {"prefill_pool_computed": 0.0, "decode_pool_computed": 0.0, "prompt_tokens": 0.0,
           **{n: 0.0 for n in DECODE}}
    for worker, now in after.items():
        was = before.get(worker, {})
        d = {k: v - was.get(k, 0.0) for k, v in now.items()}
        computed = d[COMPUTED]  # not the tokens found cached, nor those shipped in
        pool = "decode_pool_computed" if now["role_decode"] else "prefill_pool_computed"
        out[pool] += computed
        for n in DECODE:
            out[n] += d.get(n, 0.0)
    return out


def replay(args: argparse.Namespace, stack: Any, out: Path, label: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "services.cli", "bench", "run", "--address", stack.address,
           "--trace", args.trace, "--trace-conversations", str(args.conversations),
           "--trace-rate", str(args.trace_rate), "--seed", str(args.seed),
           "--max-model-len", str(args.max_model_len), "--label", label,
           "--output-dir", str(out), "--no-plots", "--no-progress",
           *(f"--slo={s}" for s in args.slo)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return dict(json.loads((out / "summary.json").read_text())["runs"][0])


async def one_config(args: argparse.Namespace, name: str, workdir: Path) -> dict[str, Any]:
    from services.bench.upstack import UpStack

    extra = [*CONFIGS[name], "--max-model-len", str(args.max_model_len),
             "--kv-cache-gib", str(args.kv_cache_gib), *args.up_arg]
    stack = UpStack(workdir / name, extra, prefill=args.prefill, decode=args.decode)
    stack.start()
    try:
        await stack.wait_ready(timeout=900, workers=args.prefill + args.decode)
        before = await counters(stack)
        started = time.monotonic()
        summary = await asyncio.to_thread(replay, args, stack, workdir / name / "bench", name)
        elapsed = time.monotonic() - started
        await asyncio.sleep(2.0)  # the last counters reach /metrics
        totals = deltas(before, await counters(stack))
    finally:
        await stack.close()
    return {"totals": totals, "replay_s": elapsed, "summary": summary}


def row(name: str, r: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    t, s = r["totals"], r["summary"]
    computed = t["prefill_pool_computed"] + t["decode_pool_computed"]
    base_computed = base["totals"]["prefill_pool_computed"] + base["totals"]["decode_pool_computed"]
    shipped = t["pdserve_kv_transfer_bytes_total"]
    base_shipped = base["totals"]["pdserve_kv_transfer_bytes_total"]
    return {
        "config": name,
        "prompt_tokens_computed": computed,
        "computed_vs_round_robin": computed / base_computed if base_computed else None,
        "kv_bytes_shipped": shipped,
        "kv_bytes_vs_round_robin": shipped / base_shipped if base_shipped else None,
        "kv_bytes_vs_all_blocks": (shipped / t["pdserve_kv_prompt_bytes_total"]
                                   if t["pdserve_kv_prompt_bytes_total"] else None),
        "decode_reused_tokens": t["pdserve_kv_reused_prefix_tokens_total"],
        "reuse_fallbacks": t["pdserve_kv_reuse_fallbacks_total"],
        "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
        "tpot_p50_s": s["tpot_s"]["p50"], "goodput": s.get("goodput"),
        "goodput_share": s.get("goodput_share"), "completed": s.get("completed"),
        "errors": s.get("errors"),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'config':<12} {'computed':>9} {'vs rr':>6} {'KV MB':>7} {'vs rr':>6} "
          f"{'vs all':>6} {'TTFT p50':>9} {'p99':>7} {'goodput%':>8}")
    for r in rows:
        def ratio(v: float | None) -> str:
            return f"{v:.2f}" if v is not None else "-"
        share = r["goodput_share"]
        print(f"{r['config']:<12} {r['prompt_tokens_computed']:>9.0f} "
              f"{ratio(r['computed_vs_round_robin']):>6} {r['kv_bytes_shipped'] / 1e6:>7.1f} "
              f"{ratio(r['kv_bytes_vs_round_robin']):>6} {ratio(r['kv_bytes_vs_all_blocks']):>6} "
              f"{r['ttft_p50_s']:>9.2f} {r['ttft_p99_s']:>7.2f} "
              f"{100 * share if share is not None else float('nan'):>8.0f}")


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    panels = [("prompt tokens computed / round robin", "computed_vs_round_robin"),
              ("KV bytes shipped / round robin", "kv_bytes_vs_round_robin")]
    for ax, (title, key) in zip(axes[:2], panels, strict=True):
        values = [r[key] or 0.0 for r in rows]
        ax.bar(names, values, color="tab:blue")
        ax.axhline(0.5, color="tab:red", linestyle="--", linewidth=0.8, label="goal 0.5")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, max(1.1, *values) * 1.1)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.legend(fontsize=7)
    ax = axes[2]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r["ttft_p50_s"] for r in rows], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [r["ttft_p99_s"] for r in rows], 0.4, label="p99")
    ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    ax.set_title("TTFT (s)", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(f"{Path(result['trace']).name}: {result['requests']} requests of "
                 f"{result['conversations']} conversations", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    workdir = Path(args.workdir)
    results: dict[str, Any] = {}
    for name in tqdm(args.configs, desc="configurations"):
        results[name] = await one_config(args, name, workdir)
    base = results.get("round_robin") or next(iter(results.values()))
    rows = [row(name, r, base) for name, r in results.items()]
    first = next(iter(results.values()))["summary"]
    return {"trace": args.trace, "conversations": args.conversations,
            "trace_rate": args.trace_rate, "slos": args.slo, "prefill": args.prefill,
            "decode": args.decode, "requests": first.get("completed"),
            "rows": rows, "results": results}


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="a Mooncake JSONL trace (hash ids "
                        "make its shared prefixes real)")
    parser.add_argument("--conversations", type=int, default=8,
                        help="whole conversations drawn from the trace")
    parser.add_argument("--trace-rate", type=float, default=0.3,
                        help="mean requests/s of the replay (the trace's gaps in proportion)")
    parser.add_argument("--seed", type=int, default=0, help="prompt contents and the draw")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="configurations to run, in this order")
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="the engines' context; the replay fits the trace to it")
    parser.add_argument("--kv-cache-gib", type=int, default=1,
                        help="KV cache per engine (small: evictions happen)")
    parser.add_argument("--slo", action="append", default=["ttft=10", "tpot=0.5"],
                        metavar="NAME=SECONDS", help="goodput SLOs (default: ttft=10, "
                        "tpot=0.5: this CPU machine's, not the trace's service's)")
    parser.add_argument("--up-arg", action="append", default=[],
                        help="one more `pdserve up` argument for every stack (repeatable)")
    parser.add_argument("--workdir", default="bench-results/trace_routing",
                        help="stack logs and each replay's full results")
    parser.add_argument("--json", default="", help="write the summary here as JSON")
    parser.add_argument("--plot", default="", help="write the ratios and TTFT here (PNG)")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print_table(result["rows"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    cli()
