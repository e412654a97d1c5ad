"""The headline comparison: disaggregated serving vs plain colocated vLLM on a mixed
workload, over a rate sweep, on the same machine.

Configurations, each started alone and driven by `pdserve bench sweep` with the same
seeded workload (chat-length requests plus a share of long prompts: the case that hurts
colocated serving):
  * colocated_default: one vLLM engine on all cores, vLLM's default step budget;
  * colocated_tuned:   the same with a 256-token chunked-prefill budget;
  * disaggregated:     one prefill worker on core 0, one decode worker on core 1.

Goodput is reported for two SLO families (see benchmark-calibration notes in
BENCHMARKS.md): per request (TTFT and TPOT bounds) and per token (every gap between
streamed chunks under a bound: smooth streaming).

    python benchmarks/headline.py --rates 0.25 0.5 0.75 --duration 90 \\
        --out bench-results/headline
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
}


def sweep(target: str, out: Path, label: str, args: argparse.Namespace) -> None:
    cmd = [sys.executable, "-m", "services.cli", "bench", "sweep", "--address", target,
           "--dataset", "mixed", "--input-len", "100", "--output-len", "128",
           "--long-share", str(args.long_share), "--long-input-len", "1800",
           "--long-output-len", "16", "--seed", "0", "--rates", *map(str, args.rates),
           "--duration", str(args.duration), "--drain-timeout", "120",
           "--warmup-s", "10", "--slo", f"ttft={args.ttft_slo}", "--slo",
           f"tpot={args.tpot_slo}", "--output-dir", str(out), "--label", label,
           "--no-progress"]
    subprocess.run(cmd, check=True, cwd=ROOT)


def goodput_by_family(out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from services.bench.metrics import SLOs, summarize
    from services.bench.report import read_records_jsonl

    records = read_records_jsonl(out / "requests.jsonl")
    rows = []
    for run in dict.fromkeys(r.run for r in records):
        mine = [r for r in records if r.run == run]
        per_request = summarize(mine, SLOs(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo))
        per_token = summarize(mine, SLOs(itl_s=args.itl_slo))
        rows.append({"run": run, "per_request": per_request, "per_token": per_token})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                        help="request rates to sweep (requests/s)")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds per rate")
    parser.add_argument("--long-share", type=float, default=0.2,
                        help="share of 1800-token prompts among the requests")
    parser.add_argument("--ttft-slo", type=float, default=20.0, help="per-request SLO: TTFT")
    parser.add_argument("--tpot-slo", type=float, default=0.28, help="per-request SLO: TPOT")
    parser.add_argument("--itl-slo", type=float, default=0.3,
                        help="per-token SLO: largest gap between streamed chunks")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="configurations to run")
    parser.add_argument("--out", default="bench-results/headline", help="output folder")
    args = parser.parse_args()

    from tests.helpers.servers import ServerProcess

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": vars(args), "configs": {}}
    for name in args.configs:
        server = ServerProcess([*CONFIGS[name], "--kv-cache-gib", "2",
                                "--no-enable-prefix-caching"], out / f"{name}.log")
        server.start()
        try:
            asyncio.run(server.wait_ready(timeout=900))
            sweep(server.target, out / name, name, args)
        finally:
            server.stop()
        result["configs"][name] = goodput_by_family(out / name, args)
        (out / "headline.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out / 'headline.json'}")


if __name__ == "__main__":
    main()
