"""``pdserve bench``: run, sweep and compare load tests.

Wired into the main CLI with ``add_parser(subparsers)``; also runnable on its own as
``python -m services.bench.cli bench run ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.bench.compare import compare_table, load_summary, write_compare_report
from services.bench.distributed import RayDriver
from services.bench.report import text_summary, write_report
from services.bench.runner import Driver, Runner, rate_label, sweep
from services.bench.served_tokenizer import served_tokenizer
from services.bench.targets import PROMPT_MODES, GrpcTarget, OpenAITarget, Target
from services.security.client_flags import add_client_security_flags, client_security
from services.traffic.flags import (
    HelpFormatter,
    add_arrival_args,
    add_workload_args,
    arrival_config,
    request_count,
    workload_config,
)
from services.traffic.slo import parse_slos
from services.traffic.workload import WorkloadConfig, build_workload, load_tokenizer

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
    if args.generators < 1:
        raise ValueError(f"--generators must be >= 1, got {args.generators}")
    n = request_count(args, rates)
    arrivals = [arrival_config(args, rate) for rate in rates]  # validate before any work
    target = build_target(args)
    tokenizer_dir, model = args.tokenizer, args.model
    if tokenizer_dir is None and _needs_tokenizer(args):
        model, folder = await served_tokenizer(build_target(args))
        tokenizer_dir = str(folder)
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    wcfg = workload_config(args, min(n, 10_000))  # longer runs reuse the specs in a cycle
    specs = build_workload(wcfg, tokenizer)
    driver: Driver
    if args.generators > 1:
        driver = RayDriver(functools.partial(build_target, args), args.generators,
                           ray_address=args.ray_address, generator_cpus=args.generator_cpus,
                           progress=not args.no_progress, drain_timeout_s=args.drain_timeout)
    else:
        driver = Runner(target, progress=not args.no_progress,
                        drain_timeout_s=args.drain_timeout)
    await driver.start()
    try:
        single = len(rates) == 1 and args.bench_command == "run"
        results = ([await driver.run(specs, arrivals[0], args.label or rate_label(rates[0]),
                                     n)] if single else
                   await sweep(driver, specs, arrivals[0], rates, n, args.sweep_pause))
    finally:
        await driver.close()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    label = args.label or default_label(target.name, wcfg)
    out_dir = Path(args.output_dir or f"bench-results/{stamp}-{label}")
    meta: dict[str, Any] = {
        "label": label, "target": target.name, "started": stamp,
        "endpoint": args.address if args.target == "pdserve" else args.base_url,
        "model": model or getattr(target, "model", ""), "tokenizer": tokenizer_dir,
        "prompt_as": args.prompt_as, "num_requests": n,
        "workload": asdict(wcfg), "command": " ".join(sys.argv[1:]),
        "generators": args.generators,
    }
    document = write_report(out_dir, results, slos, meta, with_plots=not args.no_plots)
    for summary in document["runs"]:
        print(text_summary(summary))
    print(f"results: {out_dir}")
    return 0 if all(s["completed"] > 0 for s in document["runs"]) else 1


def _needs_tokenizer(args: argparse.Namespace) -> bool:
    """Token-id prompts of the random datasets can do with --vocab-size alone."""
    return (args.vocab_size is None or args.prompt_as == "text"
            or args.dataset in ("sharegpt", "prompts"))


def default_label(target: str, wcfg: WorkloadConfig) -> str:
    """A run's name when --label gives none: the target and the workload in short, e.g.
    ``pdserve-random-256in-32out``."""
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
