"""The planner against real runs: predicted vs measured for the headline benchmark.

Takes one profile (`pdserve plan profile`) and one `benchmarks/headline.py` run of the
same day (runs either when not given), predicts the same four configurations at the same
rates on the same seeded schedule, and writes predicted vs measured TTFT p50/p99, TPOT
p50 and goodput under both SLO families, their errors, whether the planner's first choice
was the measured best at every rate, and a parity plot.

    python benchmarks/plan_validate.py --profile bench-results/plan/profile.json \\
        --headline bench-results/plan/headline.json --json bench-results/plan_validate.json \\
        --plot docs/benchmarks/plan_parity.png

Without --profile / --headline it runs `pdserve plan profile` and
`benchmarks/headline.py --rates 0.5 1 --duration 60` first (about 20 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.plan.costmodel import Profile  # noqa: E402
from services.plan.fleet import FleetConfig, PoolSpec  # noqa: E402
from services.plan.predict import predict_all  # noqa: E402
from services.traffic.arrivals import ArrivalConfig  # noqa: E402
from services.traffic.slo import SLOs  # noqa: E402
from services.traffic.workload import LengthDist, WorkloadConfig  # noqa: E402

# headline.py's configurations, as `serve` runs them: one engine on both cores, or one
# prefill and one decode engine on a core each, routed by the router's load policy.
CONFIGS = {
    "colocated_default": FleetConfig("colocated_default", PoolSpec(1, 2)),
    "colocated_tuned": FleetConfig("colocated_tuned", PoolSpec(1, 2, 256)),
    "disaggregated": FleetConfig("disaggregated", PoolSpec(1, 1), PoolSpec(1, 1)),
    "disagg_conditional": FleetConfig("disagg_conditional", PoolSpec(1, 1), PoolSpec(1, 1),
                                      local_prefill_max_tokens=256),
}
METRICS = (("ttft_p50", "ttft_p50", "TTFT p50 (s)"), ("ttft_p99", "ttft_p99", "TTFT p99 (s)"),
           ("tpot_p50", "tpot_p50", "TPOT p50 (s)"),
           ("goodput", "goodput_per_request", "goodput, TTFT+TPOT SLO (req/s)"),
           ("goodput_also", "goodput_per_token", "goodput, ITL SLO (req/s)"))


def measured_rows(paths: list[Path]) -> tuple[dict[str, Any], dict[tuple[str, float], Any]]:
    """headline.py JSON files (one run may be split over several): their args and rows."""
    args: dict[str, Any] = {}
    rows: dict[tuple[str, float], Any] = {}
    for path in paths:
        doc = json.loads(path.read_text())
        args = args or doc["args"]
        for name, runs in doc["configs"].items():
            for r in runs:
                rows[(name, float(r["rate"]))] = r
    return args, rows


def predict(profile: Profile, hargs: dict[str, Any], rates: list[float],
            names: list[str]) -> dict[tuple[str, float], dict[str, Any]]:
    """The planner's predictions on headline.py's own workload and schedule."""
    top = max(rates)
    n = math.ceil(top * hargs["duration"] * 1.5) + 16  # pdserve bench's request count
    workload = WorkloadConfig(dataset="mixed", num_requests=n, seed=0,
                              input_len=LengthDist(100), output_len=LengthDist(128),
                              long_share=hargs["long_share"], long_input_len=LengthDist(1800),
                              long_output_len=LengthDist(16), vocab_size=1000)
    arrivals = ArrivalConfig(rate=rates[0], duration_s=hargs["duration"], warmup_s=10, seed=0)
    slos = SLOs(ttft_s=hargs["ttft_slo"], tpot_s=hargs["tpot_slo"])
    also = SLOs(itl_s=hargs["itl_slo"])
    preds, took = predict_all([CONFIGS[n_] for n_ in names], profile, workload, arrivals,
                              rates, n, slos, also, hargs["drain_timeout"])
    print(f"predicted {len(names)} configurations x {len(rates)} rates in {took:.2f} s")
    return {(p.config, p.rate): p.row() for p in preds}


def rel_error(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or meas == 0:
        return None
    return (pred - meas) / meas


def compare(pred: dict[tuple[str, float], Any], meas: dict[tuple[str, float], Any],
            ) -> dict[str, Any]:
    rows, parity = [], []
    for key in sorted(pred, key=lambda k: (list(CONFIGS).index(k[0]), k[1])):
        if key not in meas:
            continue
        p, m = pred[key], meas[key]
        row: dict[str, Any] = {"config": key[0], "rate": key[1]}
        for pk, mk, label in METRICS:
            row[pk] = {"predicted": p[pk], "measured": m[mk], "error": rel_error(p[pk], m[mk])}
            parity.append({"metric": label, "config": key[0], "predicted": p[pk] or 0.0,
                           "measured": m[mk] or 0.0})
        rows.append(row)
    errors = [abs(r[k]["error"]) for r in rows for k, _, _ in METRICS
              if r[k]["error"] is not None]
    goodput = [r[k] for r in rows for k in ("goodput", "goodput_also")]
    within = [abs((g["predicted"] or 0) - g["measured"]) <= 0.15 * max(g["measured"], 1e-9)
              for g in goodput]
    choice = {}
    for rate in sorted({r["rate"] for r in rows}):
        mine = [r for r in rows if r["rate"] == rate]
        for k in ("goodput", "goodput_also"):
            best_p = max(mine, key=lambda r: r[k]["predicted"])["config"]
            best_m = max(mine, key=lambda r: r[k]["measured"])["config"]
            choice[f"{rate:g} req/s, {k}"] = {"predicted_best": best_p, "measured_best": best_m,
                                              "match": best_p == best_m}
    return {"rows": rows, "parity": parity,
            "median_abs_error": float(np.median(errors)) if errors else None,
            "errors_counted": len(errors),
            "goodput_within_15pct": f"{sum(within)}/{len(within)}",
            "first_choice": choice}


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def print_report(result: dict[str, Any]) -> None:
    print("| configuration | rate | TTFT p50 pred / meas | TTFT p99 pred / meas | "
          "TPOT p50 pred / meas | goodput (TTFT+TPOT) pred / meas | goodput (ITL) pred / meas |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in result["rows"]:
        cells = []
        for k, _, _ in METRICS:
            c = r[k]
            err = "" if c["error"] is None else f" ({100 * c['error']:+.0f}%)"
            cells.append(f"{_g(c['predicted'])} / {_g(c['measured'])}{err}")
        print(f"| {r['config']} | {r['rate']:g} | " + " | ".join(cells) + " |")
    print(f"median |error| {100 * (result['median_abs_error'] or 0):.1f}% over "
          f"{result['errors_counted']} figures; goodput within 15%: "
          f"{result['goodput_within_15pct']}")
    for k, v in result["first_choice"].items():
        print(f"  {k}: planner {v['predicted_best']}, measured {v['measured_best']}"
              f"{'' if v['match'] else '  (MISMATCH)'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="", help="profile JSON (default: measure one now)")
    p.add_argument("--headline", nargs="*", default=[],
                   help="headline.py JSON files (default: run headline.py now)")
    p.add_argument("--json", default="bench-results/plan_validate.json", help="results")
    p.add_argument("--plot", default="docs/benchmarks/plan_parity.png", help="parity plot")
    args = p.parse_args()

    out = Path("bench-results/plan")
    out.mkdir(parents=True, exist_ok=True)
    profile_path = Path(args.profile or out / "profile.json")
    if not args.profile:
        subprocess.run([sys.executable, "-m", "services.cli", "plan", "profile",
                        "--kv-cache-gib", "2", "--out", str(profile_path)], check=True, cwd=ROOT)
    headline = [Path(h) for h in args.headline]
    if not headline:
        headline = [out / "headline.json"]
        subprocess.run([sys.executable, "benchmarks/headline.py", "--rates", "0.5", "1",
                        "--duration", "60", "--runs", str(out / "headline"),
                        "--json", str(headline[0])], check=True, cwd=ROOT)
    hargs, meas = measured_rows(headline)
    rates = sorted({rate for _, rate in meas})
    names = [n for n in CONFIGS if any(k[0] == n for k in meas)]
    pred = predict(Profile.load(profile_path), hargs, rates, names)
    result = compare(pred, meas)
    result["profile"], result["headline"] = str(profile_path), [str(h) for h in headline]
    print_report(result)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    from services.plan.plots import parity

    parity(result["parity"], Path(args.plot), "planner: predicted vs measured (headline "
           "workload, 2 CPU cores)")
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
