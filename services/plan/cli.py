"""``pdserve plan``: ``profile`` measures the engine's cost model on this machine,
``predict`` simulates every configuration on a workload and recommends one
(``add_parser`` registers both with the main CLI)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from services.traffic.flags import (
    HelpFormatter,
    add_arrival_args,
    add_workload_args,
    arrival_config,
    request_count,
    workload_config,
)
from services.traffic.slo import parse_slos

DEFAULT_PROFILE = "bench-results/plan/profile.json"


def shipped_profiles() -> dict[str, Path]:
    """The profiles shipped in the package (``services/plan/profiles``), by name."""
    folder = Path(str(resources.files("services.plan") / "profiles"))
    return {p.stem: p for p in sorted(folder.glob("*.json"))}


def profile_path(value: str) -> Path:
    """--profile as a file, else as the name of a shipped profile; a missing one is a
    ValueError that says how to get one."""
    path = Path(value)
    if path.is_file():
        return path
    shipped = shipped_profiles()
    if value in shipped:
        return shipped[value]
    measure = "pdserve plan profile" + ("" if value == DEFAULT_PROFILE else f" --out {value}")
    raise ValueError(f"no profile at {value}: measure this machine with `{measure}` (a few "
                     f"minutes), or name a shipped profile with --profile "
                     f"({', '.join(shipped) or 'none shipped'})")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text}") from e
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 0: {text}")
    return values


def _profile(args: argparse.Namespace) -> int:
    from services.engine.config import EngineConfig
    from services.engine.model import ModelPrepareError
    from services.engine.reaper import reap_children_on_exit
    from services.plan.costmodel import Profile
    from services.plan.profile import QUICK, describe, refit, run_profile

    if args.refit:  # no engine: fit the saved samples again (after a change to the fit)
        profile = refit(Profile.load(Path(args.out)))
        profile.save(Path(args.out))
        print(describe(profile))
        return 0
    reap_children_on_exit()
    base = EngineConfig.model_validate({
        "model": args.model, "dtype": args.dtype, "kv_cache_gib": args.kv_cache_gib,
        "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
        "pin_scheduler": args.pin_scheduler})
    from services.plan.profile import Grid

    grid = QUICK if args.quick else Grid()
    if args.no_transports:
        grid = dataclasses.replace(grid, transports=())
    try:
        profile = run_profile(base, grid, progress=not args.no_progress)
    except ModelPrepareError as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    profile.save(out)
    print(describe(profile))
    print(f"profile ({profile.fit['profile_s']:.0f} s): {out}")
    return 0


def _print_predictions(rows: list[dict[str, Any]], also: bool) -> None:
    head = (f"{'configuration':<28} {'rate':>5} {'done':>8} {'TTFT p50':>8} {'p99':>7} "
            f"{'TPOT p50':>8} {'ITL p99':>7} {'goodput':>8}")
    print(head + (f" {'2nd SLOs':>8}" if also else ""))
    for r in rows:
        line = (f"{r['config']:<28} {r['rate']:>5g} {r['completed']:>4}/{r['requests']:<3} "
                f"{_s(r['ttft_p50']):>8} {_s(r['ttft_p99']):>7} {_s(r['tpot_p50']):>8} "
                f"{_s(r['itl_p99']):>7} {r['goodput']:>8.3f}")
        print(line + (f" {r['goodput_also']:>8.3f}" if also else ""))


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _traffic(args: argparse.Namespace) -> tuple[Any, ...]:
    """What a prediction replays, from the flags: rates, SLOs (and the also-ranked ones),
    request count, workload and arrivals."""
    rates = list(args.rates)
    if any(math.isinf(r) for r in rates):
        raise ValueError("predictions need finite rates")
    slos, also = parse_slos(args.slo), parse_slos(args.also_slo) if args.also_slo else None
    n = request_count(args, rates)
    workload = workload_config(args, min(n, 10_000))
    arrivals = arrival_config(args, rates[0])
    return rates, slos, also, n, workload, arrivals


def _predict(args: argparse.Namespace) -> int:
    from services.plan.configs import configurations, helm_values, to_yaml, up_flags
    from services.plan.costmodel import Profile
    from services.plan.plots import goodput_vs_rate
    from services.plan.predict import CLOSE_CALL, best_per_rate, close_calls, predict_all, rank
    from services.traffic.workload import load_tokenizer

    profile = Profile.load(profile_path(args.profile))
    rates, slos, also, n, workload, arrivals = _traffic(args)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    units = args.units or profile.units_total
    configs = configurations(profile, units, args.budgets, args.thresholds, args.engine_units,
                             transport=args.transport)
    if not profile.transports:
        configs = [c for c in configs if c.prefill is None]
        print("the profile has no KV transport: disaggregated configurations left out")
    predictions, took = predict_all(configs, profile, workload, arrivals, rates, n, slos,
                                    also, args.drain_timeout, not args.no_progress, tokenizer)
    rows = [p.row() for p in predictions]
    _print_predictions(rows, also is not None)
    ranking = rank(predictions)
    print(f"\n{len(configs)} configurations x {len(rates)} rates simulated in {took:.1f} s")
    print("ranking by goodput summed over the rates (req/s):")
    for name, total, per_rate in ranking[:5]:
        print(f"  {name:<28} {total:.3f}  ({', '.join(f'{g:.3f}' for g in per_rate)})")
    per_rate_best = best_per_rate(predictions)
    print("best per rate: " + ", ".join(f"{r:g} req/s: {c}" for r, c in per_rate_best.items()))
    chosen = next(c for c in configs if c.name == ranking[0][0])
    print(f"\nrecommended: {chosen.name}\n  " + " ".join(up_flags(chosen, profile)))
    print("Helm values:\n" + to_yaml(helm_values(chosen, profile), 2))
    close = close_calls(ranking)
    if close:
        print(f"note: {', '.join(close)} within {CLOSE_CALL:.0%} of the recommended one's "
              "goodput: about the planner's own error against real runs (BENCHMARKS.md), so "
              "measure the close ones with `pdserve bench sweep` before choosing")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "profile": args.profile, "rates": rates, "slos": slos.as_dict(),
            "also_slos": also.as_dict() if also else None, "seconds": took,
            "predictions": rows, "ranking": ranking,
            "best_per_rate": {str(k): v for k, v in per_rate_best.items()},
            "recommended": {"config": chosen.name, "up": up_flags(chosen, profile),
                            "helm": helm_values(chosen, profile)}}, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        goodput_vs_rate(predictions, Path(args.plot),
                        f"predicted goodput ({profile.model.get('name')}, simulation)")
        print(f"plot: {args.plot}")
    return 0


def _shape_args(args: argparse.Namespace) -> tuple[Any, Any, Any, tuple[bool, ...]]:
    """--model's shapes: the model, the GPU kind, the speculative decoding assumed and the
    modes to rank (off, on, or both)."""
    from services.plan.shapes import GPUS, MODELS, SpecDecode

    spec = SpecDecode(args.spec_tokens_per_step, args.spec_draft_tokens, args.spec_draft_cost)
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.spec_decode]
    for name, value in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if not value or 0 in value:
            raise ValueError(f"{name} needs tensor-parallel sizes >= 1, e.g. 1,2,4,8")
    return MODELS[args.model], GPUS[args.gpu], spec, modes


def _predict_shapes(args: argparse.Namespace) -> int:
    """`plan predict --model`: rank (P at TP a x m, D at TP b x n) fleets of --units GPUs
    by predicted goodput per GPU (services/plan/shapes.py)."""
    from services.plan.configs import helm_values, to_yaml, up_flags
    from services.plan.predict import predict_all, schedule
    from services.plan.shapes import plan_shapes, profile_for, rank_shapes

    model, gpu, spec, modes = _shape_args(args)
    rates, slos, also, n, workload, arrivals = _traffic(args)
    requests, _ = schedule(workload, arrivals, n)
    longest = max(r.prompt + r.out for r in requests)
    units = args.units or gpu.node_gpus
    plan = plan_shapes(model, gpu, units, args.prefill_tp, args.decode_tp, longest, spec,
                       modes, args.min_batch)
    print(f"{model.name} on {units} x {gpu.name}; longest request {longest} tokens"
          + (f"; speculative decoding assumed at {spec.tokens_per_step:g} tokens per step "
             f"({spec.draft_tokens} drafted, drafting {spec.draft_cost:.0%} of a step)"
             if any(modes) else ""))
    for bad in plan.infeasible:
        print(f"infeasible: {bad['role']} at TP {bad['tp']}: {bad['reason']}")
    if not plan.configs:
        raise ValueError(f"no shape of {model.name} fits {units} x {gpu.name}: see the "
                         "reasons above (more GPUs, or larger --prefill-tp/--decode-tp)")
    profile = profile_for(model, gpu)
    predictions, took = predict_all(plan.configs, profile, workload, arrivals, rates, n,
                                    slos, also, args.drain_timeout, not args.no_progress)
    rows = [p.row() for p in predictions]
    ranked = rank_shapes(rows, plan.shapes)
    print(f"\n{len(plan.configs)} configurations x {len(rates)} rates simulated in "
          f"{took:.1f} s; PREDICTED (no GPU ran this), at each one's best rate:")
    print(f"{'#':>3} {'configuration':<26} {'prefill':<10} {'decode':<10} {'spec':<4} "
          f"{'GPUs':>4} {'goodput/GPU':>11} {'rate':>6} {'TTFT p50':>8} {'p99':>7} "
          f"{'ITL p50':>7} {'p99':>7}")
    for i, r in enumerate(ranked[:args.top], 1):
        print(f"{i:>3} {r['config']:<26} {r['prefill']:<10} {r['decode']:<10} {r['spec']:<4} "
              f"{r['gpus']:>4} {r['goodput_per_gpu']:>11.3f} {r['rate']:>6g} "
              f"{_s(r['ttft_p50']):>8} {_s(r['ttft_p99']):>7} {_s(r['itl_p50']):>7} "
              f"{_s(r['itl_p99']):>7}")
    chosen = next(c for c in plan.configs if c.name == ranked[0]["config"])
    print(f"\nrecommended: {chosen.name}\n  " + " ".join(up_flags(chosen, profile)))
    print("Helm values:\n" + to_yaml(helm_values(chosen, profile), 2))
    if plan.shapes[chosen.name].spec:
        print("  (and speculative decoding on the decode workers: --speculative-config)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "model": args.model, "gpu": args.gpu, "gpus": units, "rates": rates,
            "slos": slos.as_dict(), "also_slos": also.as_dict() if also else None,
            "spec_decode": {"modes": args.spec_decode, **dataclasses.asdict(spec)},
            "longest_request": longest, "seconds": took, "predictions": rows,
            "shapes": ranked, "infeasible": plan.infeasible,
            "recommended": {"config": chosen.name, "up": up_flags(chosen, profile),
                            "helm": helm_values(chosen, profile)}}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _guarded(body: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Bad input and unreadable files end with a message and exit code 2, not a trace."""
    try:
        return int(body(args))
    except (ValueError, OSError, KeyError) as exc:
        print(f"pdserve plan: error: {exc}", file=sys.stderr)
        return 2


def cmd_profile(args: argparse.Namespace) -> int:
    return _guarded(_profile, args)


def cmd_predict(args: argparse.Namespace) -> int:
    return _guarded(_predict_shapes if args.model else _predict, args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``plan`` with ``profile`` and ``predict`` to the main CLI."""
    plan = subparsers.add_parser("plan", help="profile the engine and choose a configuration",
                                 description="Measure the engine's cost model, then predict "
                                 "every configuration's latency and goodput on a workload.",
                                 formatter_class=HelpFormatter)
    plan.set_defaults(func=lambda _: (plan.print_help(), 2)[1])
    sub = plan.add_subparsers(dest="plan_command", metavar="{profile,predict}")
    prof = sub.add_parser("profile", formatter_class=HelpFormatter,
                          help="measure prefill, decode and KV transfer costs (a few minutes)",
                          description="Measures the cost model with the real engine on "
                          "this machine: prefill time against prompt tokens and step budget, "
                          "decode step time against batch size and context, one core vs all "
                          "cores, and KV transport throughput. Run it alone on the machine.")
    prof.add_argument("--out", default=DEFAULT_PROFILE, help="profile JSON to write")
    prof.add_argument("--model", default="", help="HF model folder (default: the prepared "
                      "default model)")
    prof.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16",
                                                          "float16"], help="engine dtype")
    prof.add_argument("--kv-cache-gib", type=int, default=2,
                      help="CPU: the KV cache size the served engines will have")
    prof.add_argument("--max-model-len", type=int, default=2048, help="context length")
    prof.add_argument("--max-num-seqs", type=int, default=64,
                      help="most sequences in one step (as the served engines)")
    prof.add_argument("--pin-scheduler", action=argparse.BooleanOptionalAction, default=True,
                      help="CPU: profile engines with their scheduler process pinned to their "
                      "cores, as served by default (--no-pin-scheduler: as served with that "
                      "flag)")
    prof.add_argument("--quick", action="store_true",
                      help="a tiny grid on one engine (seconds of measuring; for tests)")
    prof.add_argument("--no-transports", action="store_true", help="skip the KV transports")
    prof.add_argument("--refit", action="store_true",
                      help="measure nothing: fit the samples already in --out again")
    prof.add_argument("--no-progress", action="store_true", help="no progress bar")
    prof.set_defaults(func=cmd_profile)

    pred = sub.add_parser("predict", formatter_class=HelpFormatter,
                          help="simulate configurations on a workload and recommend one",
                          description="Simulates colocated serving (default and tuned step "
                          "budgets), each P:D split and conditional disaggregation on one "
                          "seeded `pdserve bench` schedule, predicts TTFT/TPOT/ITL and goodput, "
                          "ranks them and prints the best as `pdserve up` flags and Helm values. "
                          "A prediction is as good as its profile: profile the host as it will "
                          "serve. Configurations close to the best one (the output names them) "
                          "are within the planner's error against real runs (BENCHMARKS.md, "
                          "\"Planner\"): measure them with `pdserve bench sweep` before "
                          "choosing.")
    pred.add_argument("--profile", default=DEFAULT_PROFILE,
                      help="profile JSON from `pdserve plan profile`, or the name of a shipped "
                      f"profile ({', '.join(shipped_profiles())})")
    pred.add_argument("--units", type=int, default=0,
                      help="cores (or GPUs) to plan for (default: the profiled host's)")
    pred.add_argument("--engine-units", type=int, default=1,
                      help="cores (or GPUs) per disaggregated worker")
    pred.add_argument("--budgets", type=_ints, default=(128, 256, 512), metavar="N,N",
                      help="tuned step budgets (max_num_batched_tokens) for colocated")
    pred.add_argument("--thresholds", type=_ints, default=(128, 256, 512, 1024),
                      metavar="N,N", help="conditional disaggregation thresholds "
                      "(local_prefill_max_tokens)")
    pred.add_argument("--transport", default="grpc", choices=["grpc", "torch", "nixl"],
                      help="KV transport of disaggregated configurations")
    from services.plan.shapes import GPUS, MODELS

    shapes = pred.add_argument_group(
        "shapes", "with --model, rank (prefill at TP a x m, decode at TP b x n) fleets of "
        "--units GPUs by predicted goodput per GPU, from the model's architecture and the "
        "GPU's datasheet instead of a profile (services/plan/shapes.py)")
    shapes.add_argument("--model", default=None, choices=list(MODELS),
                        help="plan tensor-parallel shapes for this model (default: none: "
                        "the configurations of --profile)")
    shapes.add_argument("--gpu", default="h100", choices=list(GPUS), help="GPU kind")
    shapes.add_argument("--prefill-tp", type=_ints, default=(1, 2, 4, 8), metavar="N,N",
                        help="prefill tensor-parallel sizes to try")
    shapes.add_argument("--decode-tp", type=_ints, default=(1, 2, 4, 8), metavar="N,N",
                        help="decode tensor-parallel sizes to try")
    shapes.add_argument("--min-batch", type=int, default=8,
                        help="a decode shape must hold this many of the longest requests' KV")
    shapes.add_argument("--spec-decode", default="off", choices=["off", "on", "both"],
                        help="speculative decoding on the decode workers (both: rank each "
                        "shape with and without)")
    shapes.add_argument("--spec-tokens-per-step", type=float, default=2.0,
                        help="assumed mean tokens a speculative step emits per sequence "
                        "(accepted drafts + 1); measure your drafter's acceptance")
    shapes.add_argument("--spec-draft-tokens", type=int, default=3,
                        help="draft tokens verified per step")
    shapes.add_argument("--spec-draft-cost", type=float, default=0.1,
                        help="drafting's cost as a share of a decode step's fixed cost")
    shapes.add_argument("--top", type=int, default=10, help="configurations to print")
    add_workload_args(pred)
    add_arrival_args(pred, sweep=True)
    pred.add_argument("--slo", action="append", default=[], metavar="NAME=SECONDS",
                      help="SLOs ranked by (repeatable; ttft, tpot, itl, e2e), e.g. "
                      "--slo ttft=4 --slo tpot=0.1 (default: none)")
    pred.add_argument("--also-slo", action="append", default=[], metavar="NAME=SECONDS",
                      help="a second SLO family to report, e.g. --also-slo itl=0.3 "
                      "(default: none)")
    pred.add_argument("--json", default="", help="write the predictions here (default: none)")
    pred.add_argument("--plot", default="", help="goodput vs rate PNG (default: none)")
    pred.add_argument("--no-progress", action="store_true", help="no progress bar")
    pred.set_defaults(func=cmd_predict, prompt_as="token-ids")
