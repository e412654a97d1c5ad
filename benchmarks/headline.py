"""The headline comparison: disaggregated serving vs plain colocated vLLM on a mixed
workload, over a rate sweep, on the same machine.

Configurations, each started alone and driven by `pdserve bench sweep` with the same
seeded workload (chat-length requests plus a share of long prompts: the case that hurts
colocated serving):
  * colocated_default:  one vLLM engine on all cores, vLLM's default step budget;
  * colocated_tuned:    the same with a 256-token chunked-prefill budget;
  * disaggregated:      one prefill worker on core 0, one decode worker on core 1, every
                        prompt prefilled on the prefill worker;
  * disagg_conditional: the same pair, prompts up to 256 tokens prefilled on the decode
                        worker (conditional disaggregation).

Goodput is reported for two SLO families: per request (TTFT and TPOT bounds) and per
token (every gap between streamed chunks under a bound: smooth streaming).

    python benchmarks/headline.py --rates 0.5 1 1.5 2 --duration 75 \\
        --json bench-results/headline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS: dict[str, list[str]] = {
    "colocated_default": ["--mode", "colocated"],
    "colocated_tuned": ["--mode", "colocated", "--max-num-batched-tokens", "256"],
    "disaggregated": ["--mode", "disagg"],
    "disagg_conditional": ["--mode", "disagg", "--local-prefill-max-tokens", "256"],
}
SEGMENTS = ("prefill_queue", "prefill", "kv_transfer", "decode_queue", "decode")


def sweep(target: str, out: Path, label: str, args: argparse.Namespace) -> None:
    from services.engine.model import resolve_model

    cmd = [sys.executable, "-m", "services.cli", "bench", "sweep", "--address", target,
           "--tokenizer", str(resolve_model("", "float32")),
           "--dataset", "mixed", "--input-len", "100", "--output-len", "128",
           "--long-share", str(args.long_share), "--long-input-len", "1800",
           "--long-output-len", "16", "--seed", "0", "--rates", *map(str, args.rates),
           "--duration", str(args.duration), "--drain-timeout", str(args.drain_timeout),
           "--sweep-pause", "5", "--warmup-s", "10", "--slo", f"ttft={args.ttft_slo}",
           "--slo", f"tpot={args.tpot_slo}", "--output-dir", str(out), "--label", label,
           "--no-progress"]
    subprocess.run(cmd, check=True, cwd=ROOT)


def p99(stats: dict[str, Any]) -> float | None:
    return stats.get("p99") if stats else None


def rows_of(out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per rate: latency tails, goodput under both SLO families, anatomy per kind."""
    from services.bench.report import read_records_jsonl
    from services.traffic.slo import SLOs
    from services.traffic.summary import anatomy_summary, summarize

    records = read_records_jsonl(out / "requests.jsonl")
    rows = []
    for run in dict.fromkeys(r.run for r in records):
        mine = [r for r in records if r.run == run]
        per_request = summarize(mine, SLOs(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo))
        per_token = summarize(mine, SLOs(itl_s=args.itl_slo))
        anatomy = {}
        for kind in ("chat", "long"):
            a = anatomy_summary([r for r in mine if r.kind == kind and not r.warmup])
            anatomy[kind] = {seg: a[seg]["mean"] for seg in SEGMENTS} if a else None
        rows.append({
            "run": run, "rate": float(run.removeprefix("rate-")),
            "requests": per_request["requests"], "completed": per_request["completed"],
            "errors": per_request["errors"],
            "ttft_p99": p99(per_request["ttft_s"]), "tpot_p99": p99(per_request["tpot_s"]),
            "itl_p99": p99(per_request["itl_s"]),
            "ttft_p50": per_request["ttft_s"].get("p50"),
            "tpot_p50": per_request["tpot_s"].get("p50"),
            "by_kind": {k: {"ttft_p99": p99(v["ttft_s"]), "tpot_p99": p99(v["tpot_s"]),
                            "itl_p99": p99(v["itl_s"])}
                        for k, v in per_request["by_kind"].items()},
            "goodput_per_request": per_request["goodput"],
            "goodput_share_per_request": per_request["goodput_share"],
            "goodput_per_token": per_token["goodput"],
            "goodput_share_per_token": per_token["goodput_share"],
            "output_token_throughput": per_request["output_token_throughput"],
            "anatomy": anatomy,
        })
    return rows


def print_table(result: dict[str, Any]) -> None:
    print(f"{'config':<20} {'rate':>5} {'done':>8} {'TTFT p99':>9} {'TPOT p99':>9} "
          f"{'ITL p99':>8} {'good/s req':>10} {'good/s tok':>10}")
    for name, rows in result["configs"].items():
        for r in rows:
            print(f"{name:<20} {r['rate']:>5g} {r['completed']:>4}/{r['requests']:<3} "
                  f"{r['ttft_p99'] or 0:>9.2f} {r['tpot_p99'] or 0:>9.3f} "
                  f"{r['itl_p99'] or 0:>8.2f} {r['goodput_per_request']:>10.3f} "
                  f"{r['goodput_per_token']:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0],
                        help="request rates to sweep (requests/s)")
    parser.add_argument("--duration", type=float, default=75.0, help="seconds per rate")
    parser.add_argument("--drain-timeout", type=float, default=45.0,
                        help="seconds to let in-flight requests finish after each rate")
    parser.add_argument("--long-share", type=float, default=0.2,
                        help="share of 1800-token prompts among the requests")
    parser.add_argument("--ttft-slo", type=float, default=4.0, help="per-request SLO: TTFT")
    parser.add_argument("--tpot-slo", type=float, default=0.1, help="per-request SLO: TPOT")
    parser.add_argument("--itl-slo", type=float, default=0.3,
                        help="per-token SLO: largest gap between streamed chunks")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="configurations to run")
    parser.add_argument("--pin-scheduler", action=argparse.BooleanOptionalAction, default=True,
                        help="keep each engine's scheduler process on its engine's cores "
                        "(the server's default)")
    parser.add_argument("--runs", default="bench-results/headline",
                        help="folder for each configuration's full bench output")
    parser.add_argument("--json", default="bench-results/headline.json",
                        help="the comparison's JSON (read by plot_results.py)")
    args = parser.parse_args()

    from tests.helpers.servers import ServerProcess

    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": vars(args), "configs": {}}
    extra = ["--pin-scheduler" if args.pin_scheduler else "--no-pin-scheduler"]
    for name in args.configs:
        server = ServerProcess([*CONFIGS[name], "--kv-cache-gib", "2",
                                "--no-enable-prefix-caching", *extra], runs / f"{name}.log")
        server.start()
        try:
            asyncio.run(server.wait_ready(timeout=900))
            sweep(server.target, runs / name, name, args)
        finally:
            server.stop()
        result["configs"][name] = rows_of(runs / name, args)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print_table(result)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
