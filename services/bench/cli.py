"""``pdserve bench``: run, sweep and compare load tests.

Wired into the main CLI with ``add_parser(subparsers)``; also runnable on its own as
``python -m services.bench.cli bench run ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from services.bench.compare import compare_table, load_summary, write_compare_report
from services.bench.distributed import RayDriver
from services.bench.report import Repeats, text_summary, write_report
from services.bench.runner import Driver, Runner, RunResult, rate_label
from services.bench.served_tokenizer import served_max_model_len, served_tokenizer
from services.bench.targets import PROMPT_MODES, GrpcTarget, OpenAITarget, Target
from services.security.client_flags import add_client_security_flags, client_security
from services.traffic.arrivals import TRACE
from services.traffic.flags import (
    HelpFormatter,
    add_arrival_args,
    add_workload_args,
    arrival_config,
    positive_rate,
    request_count,
    workload_config,
)
from services.traffic.intervals import METHODS
from services.traffic.request import RequestSpec
from services.traffic.slo import parse_slos
from services.traffic.traces import TRACE_FORMATS, Replay, ReplayConfig, plan_replay, read_trace
from services.traffic.workload import (
    Tokenizer,
    WorkloadConfig,
    build_workload,
    load_tokenizer,
    token_pool,
)

_FMT = HelpFormatter


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--target", choices=("pdserve", "openai"), default="pdserve",
                   help="pdserve gRPC Generate, or an OpenAI-compatible /v1/completions server")
    g.add_argument("--address", default="127.0.0.1:50051", help="pdserve gRPC host:port")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="OpenAI-compatible server URL (e.g. `vllm serve`)")
    g.add_argument("--model", default="",
                   help="model name to send (default: pdserve's served model, or the first "
                   "model the OpenAI server lists)")
    add_client_security_flags(g)  # --api-key (both targets), --tls* (pdserve)
    g.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                   help="a non-loopback host that may receive load (repeatable; default: "
                   "none: loopback only)")
    g.add_argument("--prompt-as", choices=PROMPT_MODES, default="token-ids",
                   help="send prompts as token ids (exact lengths) or as text")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="per-request deadline in seconds")
    g.add_argument("--grpc-channels", type=int, default=1,
                   help="gRPC connections to spread requests over")
    g.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help="extra fields merged into each OpenAI request body (default: none)")
    g = p.add_argument_group("load generators")
    g.add_argument("--generators", type=int, default=1,
                   help="processes that send the load: above 1, Ray actors each sending "
                   "an equal share of the one schedule, results merged (use when one "
                   "process cannot keep up; see BENCHMARKS.md for one process's ceiling)")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to place the generators on (default: a local Ray)")
    g.add_argument("--generator-cpus", type=float, default=0.0,
                   help="CPUs each generator actor reserves in Ray (0: no reservation)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--slo", action="append", default=[], metavar="NAME=SECONDS",
                   help="goodput SLO, all must hold (repeatable; names: ttft, tpot, itl "
                   "= largest chunk gap, e2e), e.g. --slo ttft=2 --slo tpot=0.28 (default: none: "
                   "every completed request counts)")
    g.add_argument("--output-dir", default=None,
                   help="where files go (default: bench-results/<time>-<label>)")
    g.add_argument("--label", default="",
                   help="name of this run in files and plots (default: the target and the "
                   "workload, e.g. pdserve-random-256in-32out, each run in it named by its rate)")
    g.add_argument("--no-plots", action="store_true", help="skip PNG plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_trace_args(p: argparse.ArgumentParser, is_sweep: bool) -> None:
    g = p.add_argument_group(
        "trace replay", "Replay a production trace instead of --dataset: its arrival times, "
        "lengths and (Mooncake) shared prefixes; --num-requests caps the window's requests, "
        "--duration, --max-concurrency and warm-up still apply (docs/benchmarking.md)")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="trace file: Azure LLM inference CSV or Mooncake JSONL (default: "
                   "none: --dataset)")
    g.add_argument("--trace-format", choices=("auto", *TRACE_FORMATS), default="auto",
                   help="the trace's format (auto: recognised by its content)")
    if is_sweep:
        p.set_defaults(speed=1.0, trace_rate=None)  # a sweep's --rates rescale the trace
    else:
        g.add_argument("--speed", type=float, default=1.0,
                       help="replay the trace this many times faster than it ran (0.5: "
                       "half as fast)")
        g.add_argument("--trace-rate", type=positive_rate, default=None, metavar="RATE",
                       help="instead of --speed: stretch the window's arrivals to this mean "
                       "rate (requests/s), gaps kept in proportion (default: none)")
    g.add_argument("--trace-start", type=float, default=0.0,
                   help="window start, seconds after the trace's first request")
    g.add_argument("--trace-duration", type=float, default=None,
                   help="window length in seconds of trace time (default: to the end)")
    g.add_argument("--length-scale", default="auto", metavar="auto|FACTOR",
                   help="factor on the trace's prompt and output lengths; auto: Mooncake "
                   "maps one trace block to one KV block, Azure scales so 99%% of the "
                   "window fits --max-model-len; requests still too long are clipped")
    g.add_argument("--trace-conversations", type=int, default=None, metavar="N",
                   help="Mooncake: replay every turn of N conversations drawn at random "
                   "(--seed) from the window, instead of consecutive requests (default: "
                   "none: the window's requests)")
    g.add_argument("--trace-sample-seed", type=int, default=None, metavar="SEED",
                   help="seed of the --trace-conversations draw, so runs with different "
                   "--seed (prompt tokens) replay the same conversations (default: --seed)")
    g.add_argument("--trace-min-turns", type=int, default=1, metavar="N",
                   help="--trace-conversations draws only conversations of at least N "
                   "requests (default: 1: any)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context (prompt + output tokens) the trace's lengths are fitted "
                   "to (default: the served model's)")
    g.add_argument("--kv-block-size", type=int, default=128,
                   help="the engines' KV block size in tokens: a Mooncake block becomes a "
                   "whole number of them (vLLM's default is 128 on CPU, 16 on GPU)")
    g.add_argument("--no-turn-order", action="store_true",
                   help="send every request at its own time, even before the earlier turn "
                   "of its conversation has finished")


def _add_repeat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("repetitions")
    g.add_argument("--runs", type=int, default=1,
                   help="repeat each run N times (same schedule, fresh prompt tokens each "
                   "time); figures are then medians of the runs with confidence intervals")
    g.add_argument("--confidence-level", type=float, default=0.95,
                   help="level of the intervals of repeated runs")
    g.add_argument("--interval-method", choices=METHODS, default="t",
                   help="t: Student's t interval on the mean of the runs (as AIPerf); "
                   "order: distribution-free order-statistic interval on the median")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``bench`` with ``run``, ``sweep`` and ``compare`` to the main CLI."""
    bench = subparsers.add_parser("bench", help="load-test pdserve or an OpenAI server",
                                  description="Load-test pdserve or an OpenAI-compatible "
                                  "server, and compare results.", formatter_class=_FMT)
    bench.set_defaults(func=lambda _: (bench.print_help(), 2)[1])
    sub = bench.add_subparsers(dest="bench_command", metavar="{run,sweep,compare}")
    run = sub.add_parser("run", help="one run at one rate", formatter_class=_FMT,
                         description="One benchmark run at one request rate.")
    sweep = sub.add_parser("sweep", help="one run per request rate", formatter_class=_FMT,
                           description="Runs at several request rates, one after another.")
    for p, is_sweep in ((run, False), (sweep, True)):
        _add_target_args(p)
        add_workload_args(p, served=True)
        add_arrival_args(p, is_sweep)
        _add_trace_args(p, is_sweep)
        _add_repeat_args(p)
        _add_output_args(p)
    run.set_defaults(func=cmd_run)
    sweep.set_defaults(func=cmd_sweep)
    cmp = sub.add_parser("compare", help="compare two summary.json files", formatter_class=_FMT,
                         description="Prints two benchmark summaries side by side.")
    cmp.add_argument("a", type=Path, help="baseline summary.json")
    cmp.add_argument("b", type=Path, help="summary.json to compare with the baseline")
    cmp.add_argument("--output-dir", type=Path, default=None,
                     help="also write side-by-side plots and compare.html here "
                     "(default: table only)")
    cmp.set_defaults(func=cmd_compare)


def _typed_target(args: argparse.Namespace) -> GrpcTarget | OpenAITarget:
    target = build_target(args)
    assert isinstance(target, GrpcTarget | OpenAITarget)
    return target


def build_target(args: argparse.Namespace) -> Target:
    if args.target == "pdserve":
        return GrpcTarget(args.address, model=args.model, allowed_hosts=args.allow_host,
                          timeout_s=args.request_timeout, prompt_mode=args.prompt_as,
                          num_channels=args.grpc_channels, **client_security(args))
    return OpenAITarget(args.base_url, model=args.model, allowed_hosts=args.allow_host,
                        timeout_s=args.request_timeout, prompt_mode=args.prompt_as,
                        extra_body=args.extra_body, api_key=client_security(args)["api_key"])


async def _execute(args: argparse.Namespace, rates: list[float]) -> int:
    slos = parse_slos(args.slo)
    repeats = Repeats(args.runs, args.confidence_level, args.interval_method)
    if args.generators < 1:
        raise ValueError(f"--generators must be >= 1, got {args.generators}")
    replaying = args.trace is not None
    if replaying:
        _check_trace_flags(args)
    n = 1 if replaying else request_count(args, rates)  # a replay: the window's count
    arrivals = [arrival_config(args, rate) for rate in rates]  # validate before any work
    target = build_target(args)
    tokenizer_dir, model = args.tokenizer, args.model
    if tokenizer_dir is None and _needs_tokenizer(args):
        model, folder = await served_tokenizer(build_target(args))
        tokenizer_dir = str(folder)
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    wcfg = workload_config(args, min(n, 10_000))  # longer runs reuse the specs in a cycle
    replays: dict[tuple[int, int], Replay] = {}
    if replaying:
        trace_cfg = await _replay_config(args)
        trace = read_trace(args.trace, trace_cfg.format)
        pool = token_pool(tokenizer, args.vocab_size)
        for r, rate in enumerate(rates):
            for k in range(repeats.runs):  # fresh prompt tokens in each repetition
                cfg = replace(trace_cfg, seed=args.seed + k,
                              rate=rate if args.bench_command == "sweep" else trace_cfg.rate)
                replays[r, k] = plan_replay(cfg, pool, trace)
                _with_text(replays[r, k].specs, args.prompt_as, tokenizer)
        n = len(replays[0, 0].specs)

    def specs_for(r: int, k: int) -> list[RequestSpec]:
        if replaying:
            return replays[r, k].specs
        return build_workload(replace(wcfg, seed=args.seed + k), tokenizer)

    driver: Driver
    if args.generators > 1:
        driver = RayDriver(functools.partial(build_target, args), args.generators,
                           ray_address=args.ray_address, generator_cpus=args.generator_cpus,
                           progress=not args.no_progress, drain_timeout_s=args.drain_timeout)
    else:
        driver = Runner(target, progress=not args.no_progress,
                        drain_timeout_s=args.drain_timeout)
    results: list[RunResult] = []
    await driver.start()
    try:
        for r, rate in enumerate(rates):
            label = _run_label(args, rate, replays.get((r, 0)))
            for k in range(repeats.runs):
                if results and getattr(args, "sweep_pause", 0.0) > 0:
                    await asyncio.sleep(args.sweep_pause)  # let the server's queues empty
                arrival = (replace(arrivals[r], process=TRACE, rate=replays[r, k].mean_rate)
                           if replaying else arrivals[r])
                name = f"{label}/run-{k + 1}" if repeats.runs > 1 else label
                result = await driver.run(specs_for(r, k), arrival, name, n)
                result.group = label if repeats.runs > 1 else ""
                results.append(result)
    finally:
        await driver.close()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    label = args.label or default_label(target.name, wcfg, args.trace)
    out_dir = Path(args.output_dir or f"bench-results/{stamp}-{label}")
    meta: dict[str, Any] = {
        "label": label, "target": target.name, "started": stamp,
        "endpoint": args.address if args.target == "pdserve" else args.base_url,
        "model": model or getattr(target, "model", ""), "tokenizer": tokenizer_dir,
        "prompt_as": args.prompt_as, "num_requests": n,
        "workload": ({"dataset": "trace", "path": args.trace, "seed": args.seed}
                     if replaying else asdict(wcfg)),
        "command": " ".join(sys.argv[1:]),
        "generators": args.generators,
    }
    if replaying:
        meta["trace"] = replays[0, 0].description
    if repeats.runs > 1:
        meta["repeats"] = {"runs": repeats.runs, "confidence_level": repeats.level,
                           "method": repeats.method,
                           "seeds": "prompt tokens from --seed + k in repetition k; the "
                                    "arrival schedule from --seed in every repetition"}
    document = write_report(out_dir, results, slos, meta, with_plots=not args.no_plots,
                            repeats=repeats)
    if replaying:
        print(trace_summary(meta["trace"]))
    for summary in document["runs"]:
        print(text_summary(summary))
    print(f"results: {out_dir}")
    return 0 if all(s["completed"] > 0 for s in document["runs"]) else 1


def _check_trace_flags(args: argparse.Namespace) -> None:
    """Flags of generated traffic that a replay cannot honour: an error, not silence."""
    if args.arrival != "poisson" or args.burstiness != 1.0 or args.ramp_from is not None:
        raise ValueError("--arrival, --burstiness and --ramp-from do not apply to a trace "
                         "replay (its arrivals are the trace's): use --speed or --trace-rate")
    if args.bench_command == "run" and not math.isinf(args.rate):
        raise ValueError("--rate does not apply to a trace replay: use --trace-rate to "
                         "stretch the trace to a mean rate, or --speed")
    if args.dataset != "random" or args.dataset_path:
        raise ValueError("--trace replaces --dataset: give one of them")


async def _replay_config(args: argparse.Namespace) -> ReplayConfig:
    """The replay the flags describe; the context length asked from the server unless
    --max-model-len gives it."""
    scale: float | None = None
    if str(args.length_scale).lower() != "auto":
        try:
            scale = float(args.length_scale)
        except ValueError:
            raise ValueError(f"--length-scale takes auto or a number, got "
                             f"{args.length_scale!r}") from None
    max_len = args.max_model_len
    if max_len is None:
        max_len = await served_max_model_len(_typed_target(args))
    return ReplayConfig(
        path=args.trace, format=None if args.trace_format == "auto" else args.trace_format,
        start_s=args.trace_start, duration_s=args.trace_duration,
        max_requests=args.num_requests, speed=args.speed, rate=args.trace_rate,
        length_scale=scale, max_model_len=max_len, kv_block_size=args.kv_block_size,
        keep_turn_order=not args.no_turn_order, seed=args.seed,
        conversations=args.trace_conversations, min_turns=args.trace_min_turns,
        sample_seed=(args.seed if args.trace_sample_seed is None
                     else args.trace_sample_seed))


def _with_text(specs: list[RequestSpec], prompt_as: str, tokenizer: Tokenizer | None) -> None:
    if prompt_as != "text":
        return
    if tokenizer is None:
        raise ValueError("text prompts need the model's tokenizer")
    for spec in specs:
        spec.prompt_text = tokenizer.decode(spec.prompt_ids)


def _run_label(args: argparse.Namespace, rate: float, replay: Replay | None) -> str:
    if replay is None or args.bench_command == "sweep":
        return (args.label or rate_label(rate)) if args.bench_command == "run" else rate_label(
            rate)
    if args.label:
        return str(args.label)
    return (f"trace-rate-{args.trace_rate:g}" if args.trace_rate is not None
            else f"speed-{args.speed:g}")


def trace_summary(description: dict[str, Any]) -> str:
    """One line on what was replayed, for the terminal."""
    d, lengths, win = description, description["lengths"], description["window"]
    timing = (f"mean rate {d['rate']:g} req/s" if d.get("rate") is not None
              else f"speed x{d['speed']:g}")
    reuse = (f", {100 * d['prefix_reuse']['share']:.0f}% of prompt blocks shared with an "
             "earlier request" if d.get("prefix_reuse") else "")
    return (f"trace {d['file']} ({d['format']}): {win['requests']} requests from "
            f"{win['start_s']:g} s, {timing}; lengths x{lengths['factor']:.4g} "
            f"(max_model_len {lengths['max_model_len']}, {lengths['clipped_requests']} "
            f"clipped){reuse}; {d['turns']['next_turn_requests']} later turns")


def _needs_tokenizer(args: argparse.Namespace) -> bool:
    """Token-id prompts of the random datasets can do with --vocab-size alone."""
    return (args.vocab_size is None or args.prompt_as == "text"
            or args.dataset in ("sharegpt", "prompts"))


def default_label(target: str, wcfg: WorkloadConfig, trace: str | None = None) -> str:
    """A run's name when --label gives none: the target and the workload in short, e.g.
    ``pdserve-random-256in-32out`` or ``pdserve-trace-mooncake_conversation``."""
    if trace:
        return f"{target}-trace-{Path(trace).stem}"
    if wcfg.dataset in ("sharegpt", "prompts"):
        return f"{target}-{wcfg.dataset}-{Path(wcfg.path or '').stem}"
    lengths = f"{wcfg.input_len.mean}in-{wcfg.output_len.mean}out"
    if wcfg.dataset == "mixed":
        lengths += f"-{wcfg.long_share:g}long"
    return f"{target}-{wcfg.dataset}-{lengths}"


def cmd_run(args: argparse.Namespace) -> int:
    return _guard(lambda: asyncio.run(_execute(args, [args.rate])))


def cmd_sweep(args: argparse.Namespace) -> int:
    return _guard(lambda: asyncio.run(_execute(args, list(args.rates))))


def cmd_compare(args: argparse.Namespace) -> int:
    def go() -> int:
        print(compare_table(load_summary(args.a), load_summary(args.b)))
        if args.output_dir is not None:
            print(f"report: {write_compare_report(args.a, args.b, args.output_dir)}")
        return 0
    return _guard(go)


def _guard(body: Callable[[], int]) -> int:
    """Bad input and unreachable files end with a message and exit code 2, not a trace."""
    try:
        return int(body())
    except (ValueError, OSError) as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
