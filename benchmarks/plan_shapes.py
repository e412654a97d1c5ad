"""The planner's shape table: `pdserve plan predict --model`'s ranking of (prefill at TP a x
m, decode at TP b x n) fleets, beside the shapes of published recipes, for the model,
GPUs and workload each recipe states. A PREDICTION from datasheet figures
(services/plan/shapes.py): no GPU runs here.

    python benchmarks/plan_shapes.py --json bench-results/plan/shapes.json

Recipes (the shapes as published; the workload is the recipe's own benchmark job, or the
one its guide names):

- NVIDIA Dynamo, recipes/llama-3-70b/vllm/disagg-single-node (github.com/ai-dynamo/
  dynamo): Llama-3.3-70B-Instruct-FP8-dynamic on 8 x H100 or H200, 2 prefill workers at
  TP 2 and 1 decode worker at TP 4; its perf job: ISL 8192, OSL 1024.
- NVIDIA Dynamo, recipes/llama-3-70b/vllm/disagg-multi-node: 16 GPUs, 1 prefill worker at
  TP 8 and 1 decode worker at TP 8; ISL 8192, OSL 1024.
- llm-d, guides/pd-disaggregation (github.com/llm-d/llm-d): Llama-3.3-70B-Instruct-FP8 on
  8 x H200, 4 prefill workers at TP 1 and 1 decode worker at TP 4; the guide aims P/D at
  "10k ISL | 1k OSL" workloads.

Neither recipe states an SLO; the table ranks under two families, our choice: TTFT <= 2 s
and TPOT <= 50 ms (20 tokens/s per user; --slo), and TTFT <= 2 s with no gap between two
tokens over 100 ms (--also-slo: the stalls a prefill causes in a colocated engine's
streams count).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.plan.predict import predict_all, schedule  # noqa: E402
from services.plan.shapes import (  # noqa: E402
    GPUS,
    MODELS,
    Shape,
    plan_shapes,
    profile_for,
    rank_shapes,
)
from services.traffic.arrivals import ArrivalConfig  # noqa: E402
from services.traffic.slo import parse_slos  # noqa: E402
from services.traffic.workload import LengthDist, WorkloadConfig  # noqa: E402


@dataclass(frozen=True)
class Recipe:
    source: str
    gpu: str
    gpus: int
    shape: Shape
    isl: int
    osl: int


RECIPES = [
    Recipe("Dynamo disagg-single-node", "h100", 8, Shape(4, 1, 2, 2), 8192, 1024),
    Recipe("Dynamo disagg-single-node", "h200", 8, Shape(4, 1, 2, 2), 8192, 1024),
    Recipe("Dynamo disagg-multi-node", "h200", 16, Shape(8, 1, 8, 1), 8192, 1024),
    Recipe("llm-d pd-disaggregation", "h200", 8, Shape(4, 1, 1, 4), 10240, 1024),
]


def run(recipe: Recipe, model: str, per_gpu_rates: list[float], duration: float,
        slo: list[str], also: list[str]) -> dict[str, Any]:
    workload = WorkloadConfig(dataset="random", input_len=LengthDist(recipe.isl),
                              output_len=LengthDist(recipe.osl), seed=0)
    rates = [round(r * recipe.gpus, 3) for r in per_gpu_rates]
    arrivals = ArrivalConfig(rate=rates[0], duration_s=duration, warmup_s=duration / 6,
                             seed=0)
    n = int(max(rates) * duration * 1.5) + 16
    requests, _ = schedule(workload, arrivals, n)
    longest = max(r.prompt + r.out for r in requests)
    spec, gpu = MODELS[model], GPUS[recipe.gpu]
    plan = plan_shapes(spec, gpu, recipe.gpus, (1, 2, 4, 8), (1, 2, 4, 8), longest)
    t0 = time.perf_counter()
    preds, _ = predict_all(plan.configs, profile_for(spec, gpu), workload, arrivals, rates,
                           n, parse_slos(slo), parse_slos(also), drain_s=duration)
    rows = [p.row() for p in preds]
    mine = recipe.shape.name
    out: dict[str, Any] = {
        "recipe": recipe.source, "gpu": recipe.gpu, "gpus": recipe.gpus, "isl": recipe.isl,
        "osl": recipe.osl, "recipe_config": mine, "configurations": len(plan.configs),
        "rates": rates, "infeasible": plan.infeasible, "predictions": rows}
    for family, key in (("slo", "goodput"), ("also", "goodput_also")):
        ranked = rank_shapes(rows, plan.shapes, key)
        names = [r["config"] for r in ranked]
        out[family] = {"top": ranked[:5],
                       "recipe_rank": names.index(mine) + 1 if mine in names else None,
                       "recipe_row": ranked[names.index(mine)] if mine in names else None}
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.3-70b-fp8", choices=list(MODELS))
    p.add_argument("--per-gpu-rates", type=float, nargs="+",
                   default=[0.1, 0.15, 0.2, 0.225, 0.25, 0.275, 0.3, 0.35, 0.4],
                   help="request rates per GPU to sweep (each fleet: times its GPUs)")
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds")
    p.add_argument("--slo", action="append", default=None, metavar="NAME=SECONDS",
                   help="SLOs (default: ttft=2, tpot=0.05)")
    p.add_argument("--also-slo", action="append", default=None, metavar="NAME=SECONDS",
                   help="the second SLO family (default: ttft=2, itl=0.1)")
    p.add_argument("--recipes", nargs="+", default=None, metavar="TEXT",
                   help="only the recipes whose source names one of these (e.g. llm-d)")
    p.add_argument("--json", default="bench-results/plan/shapes.json", help="results")
    args = p.parse_args()
    slo = args.slo or ["ttft=2", "tpot=0.05"]
    also = args.also_slo or ["ttft=2", "itl=0.1"]
    out: dict[str, Any] = {"args": vars(args), "slo": slo, "also_slo": also, "results": []}
    chosen = [r for r in RECIPES
              if not args.recipes or any(t in r.source for t in args.recipes)]
    for recipe in chosen:
        res = run(recipe, args.model, args.per_gpu_rates, args.duration, slo, also)
        out["results"].append(res)
        for family in ("slo", "also"):
            got = res[family]
            top = ", ".join(f"{r['config']} {r['goodput_per_gpu']:.3f}"
                            for r in got["top"][:3])
            row = got["recipe_row"]
            print(f"{recipe.source} {recipe.gpus} x {recipe.gpu} [{family}]: top {top}; "
                  f"recipe {res['recipe_config']} rank {got['recipe_rank']}"
                  + (f" {row['goodput_per_gpu']:.3f}" if row else ""), flush=True)
        print(f"  ({res['configurations']} configurations, {res['seconds']:.0f} s)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
