"""Where disaggregation pays: a SIMULATION with a published GPU profile.

With the cost model in services/plan/profiles/llama-3.1-8b-h100.json (Llama-3.1-8B on
H100s; every number's source is inside the file), the planner's fleet simulation finds,
for 8 to 64 GPUs and two workloads, the highest request rate at which 90% of requests
meet the SLOs (DistServe's goodput), for colocated serving (vLLM's default step budget
and two tuned ones) and for P:D splits (with and without conditional disaggregation),
and plots the best of each family per GPU. Nothing here runs an engine.

    python benchmarks/plan_crossover.py --json bench-results/plan_crossover.json \\
        --plot docs/benchmarks/plan_crossover.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.plan.costmodel import Profile, StepCost  # noqa: E402
from services.plan.fleet import Fleet, FleetConfig, PoolSpec  # noqa: E402
from services.plan.predict import schedule, slo_attainment  # noqa: E402
from services.traffic.arrivals import ArrivalConfig  # noqa: E402
from services.traffic.slo import SLOs  # noqa: E402
from services.traffic.workload import LengthDist, WorkloadConfig  # noqa: E402

PROFILE = ROOT / "services/plan/profiles/llama-3.1-8b-h100.json"


@dataclass(frozen=True)
class Study:
    name: str
    workload: WorkloadConfig
    slos: SLOs


STUDIES = [
    Study("chat: 256-768 prompt, 128-384 output tokens; TTFT <= 0.5 s, TPOT <= 30 ms",
          WorkloadConfig(dataset="random", input_len=LengthDist(512, "uniform", 0.5),
                         output_len=LengthDist(256, "uniform", 0.5), seed=0),
          SLOs(ttft_s=0.5, tpot_s=0.03)),
    Study("long context: 6k-10k prompt, 128-384 output tokens; TTFT <= 3 s, TPOT <= 30 ms",
          WorkloadConfig(dataset="random", input_len=LengthDist(8000, "uniform", 0.25),
                         output_len=LengthDist(256, "uniform", 0.5), seed=0,
                         max_total_len=16384),
          SLOs(ttft_s=3.0, tpot_s=0.03)),
]


def families(gpus: int, transport: str) -> dict[str, list[FleetConfig]]:
    """The configurations of each family at one fleet size."""
    colocated = [FleetConfig(f"colocated_b{b or 'default'}", PoolSpec(gpus, 1, b))
                 for b in (0, 2048)]
    splits = sorted({max(1, min(gpus - 1, round(gpus * f))) for f in
                     (1 / 4, 3 / 8, 1 / 2, 5 / 8)})
    disagg = [FleetConfig(f"disagg_{p}p{gpus - p}d", PoolSpec(gpus - p, 1), PoolSpec(p, 1),
                          transport=transport) for p in splits]
    conditional = [replace(c, name=c.name.replace("disagg", "conditional") + "_t1024",
                           local_prefill_max_tokens=1024) for c in disagg]
    return {"colocated": colocated, "disaggregated": disagg + conditional}


def attainment(cfg: FleetConfig, prof: Profile, study: Study, rate: float,
               duration: float) -> float:
    arrivals = ArrivalConfig(rate=rate, duration_s=duration, warmup_s=duration / 5, seed=0)
    n = int(rate * duration * 1.3) + 16
    reqs, warm = schedule(replace(study.workload, num_requests=min(n, 10_000)), arrivals, n)
    results = Fleet(cfg, prof).run(reqs, duration * 3, light=True)
    return slo_attainment(results, warm, study.slos)


def max_rate(cfg: FleetConfig, prof: Profile, study: Study, gpus: int, duration: float,
             start: float, target: float = 0.9) -> float:
    """The highest rate (req/s, whole fleet) with ``target`` of requests in the SLOs: grow
    by 1.5x until it fails, then bisect four times."""
    lo, hi = 0.0, start * gpus
    while attainment(cfg, prof, study, hi, duration) >= target:
        lo, hi = hi, hi * 1.5
        if hi > 1e5:
            break
    for _ in range(4):
        mid = (lo + hi) / 2
        if attainment(cfg, prof, study, mid, duration) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def with_mfu(prof: Profile, mfu: float) -> Profile:
    """The profile with prefill compute at another utilisation than its 50%."""
    c = prof.step_cost[1]
    scaled = StepCost(c.base_s, c.prefill_token_s * 0.5 / mfu, c.decode_seq_s,
                      c.attention_s * 0.5 / mfu, c.decode_context_s, c.request_s)
    return replace(prof, step_cost={1: scaled})


def plot(results: list[dict[str, Any]], path: Path) -> None:
    from services.plan.plots import crossover

    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in results:
        lines = series.setdefault(f"{r['study'].split(':')[0]} (MFU {r['mfu']:.0%})", {})
        lines.setdefault(r["family"], []).append((r["gpus"], r["rate"] / r["gpus"]))
    crossover(series, path, "SIMULATION: Llama-3.1-8B on H100 (published profile), "
              "max goodput per GPU at 90% SLO attainment")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64],
                   help="fleet sizes")
    p.add_argument("--duration", type=float, default=10.0,
                   help="simulated seconds of arrivals per point")
    p.add_argument("--transport", default="torch", choices=["grpc", "torch"],
                   help="KV transport of the profile (torch: the RDMA-class figure)")
    p.add_argument("--mfu", type=float, nargs="+", default=[0.5],
                   help="prefill utilisations to run (the profile's is 0.5)")
    p.add_argument("--json", default="bench-results/plan_crossover.json", help="results")
    p.add_argument("--plot", default="docs/benchmarks/plan_crossover.png", help="plot")
    p.add_argument("--replot", action="store_true",
                   help="simulate nothing: draw --plot again from the results in --json")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.json).read_text())["results"], Path(args.plot))
        return

    base = Profile.load(PROFILE)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"profile": str(PROFILE.relative_to(ROOT)), "args": vars(args),
                           "results": []}
    for mfu in args.mfu:
        prof = with_mfu(base, mfu)
        for study in STUDIES:
            start = {"colocated": 10.0 if study.name.startswith("chat") else 0.5}
            for gpus in args.gpus:
                for family, cfgs in families(gpus, args.transport).items():
                    # start each search near the last fleet size's best rate per GPU
                    first = 0.8 * start.get(family, start["colocated"])
                    rates = {c.name: max_rate(c, prof, study, gpus, args.duration, first)
                             for c in cfgs}
                    best = max(rates, key=lambda k: rates[k])
                    out["results"].append({"study": study.name, "mfu": mfu, "gpus": gpus,
                                           "family": family, "best": best,
                                           "rate": rates[best], "all": rates})
                    start[family] = max(rates[best] / gpus, 0.05)
                    print(f"{study.name.split(':')[0]:<12} MFU {mfu:.2f} {gpus:>3} GPUs "
                          f"{family:<14} best {best:<26} {rates[best]:8.1f} req/s "
                          f"({rates[best] / gpus:.2f}/GPU)", flush=True)
    out["seconds"] = time.perf_counter() - t0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    plot(out["results"], Path(args.plot))
    print(f"wrote {args.json} and {args.plot} in {out['seconds']:.0f} s")


if __name__ == "__main__":
    main()
