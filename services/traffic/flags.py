"""Command-line flags that describe traffic: the workload and arrival groups, shared
by ``pdserve bench`` (which sends the traffic) and ``pdserve plan predict`` (which
simulates it), so both read one schedule from the same flags."""

from __future__ import annotations

import argparse
import math

from services.traffic.arrivals import PROCESSES, ArrivalConfig
from services.traffic.workload import DATASETS, DISTRIBUTIONS, LengthDist, WorkloadConfig

DEFAULT_REQUESTS = 200


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def positive_rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 (or inf), got {text}")
    return value


def add_workload_args(p: argparse.ArgumentParser, served: bool = False) -> None:
    """The "workload" group: which requests, with what lengths (``workload_config``);
    ``served``: a server is at hand to name its model, whose tokenizer is the default."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="random", help="request source")
    g.add_argument("--dataset-path", default=None,
                   help="ShareGPT JSON file, or prompts file (.txt one per line, .jsonl "
                   "with a 'prompt' field) (default: none)")
    if served:
        g.add_argument("--tokenizer", default=None, metavar="MODEL_DIR",
                       help="local model folder whose tokenizer draws and counts prompt "
                       "tokens (default: the served model's, when the server names a local "
                       "folder or a model `pdserve model prepare` wrote)")
    else:
        g.add_argument("--tokenizer", default=None, metavar="MODEL_DIR",
                       help="local model folder whose tokenizer counts lengths; needed for "
                       "sharegpt, prompts and --prompt-as text (default: none)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="token id range for random prompts (default: the tokenizer's)")
    g.add_argument("--num-requests", type=int, default=None,
                   help=f"requests per run (default: {DEFAULT_REQUESTS}; with --duration: "
                   "enough for the duration)")
    g.add_argument("--input-len", type=int, default=256, help="mean prompt tokens")
    g.add_argument("--output-len", type=int, default=None,
                   help="mean output tokens (default: 128; sharegpt: the reply's length)")
    g.add_argument("--len-dist", choices=DISTRIBUTIONS, default="uniform",
                   help="length distribution (spread 0 gives fixed lengths)")
    g.add_argument("--input-spread", type=float, default=0.0,
                   help="input length spread (uniform: +-share of the mean; normal: std / "
                   "mean; lognormal: sigma)")
    g.add_argument("--output-spread", type=float, default=0.0, help="output length spread")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: prefixes")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens")
    g.add_argument("--long-share", type=float, default=0.1,
                   help="mixed: share of long prompts among chat-length requests")
    g.add_argument("--long-input-len", type=int, default=1800, help="mixed: long prompt tokens")
    g.add_argument("--long-output-len", type=int, default=16, help="mixed: long output tokens")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals")


def add_arrival_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    """The "arrivals" group: when requests are sent (``arrival_config``); ``--rates``
    for a sweep, else ``--rate``."""
    g = p.add_argument_group("arrivals")
    if sweep:
        g.add_argument("--rates", type=positive_rate, nargs="+", required=True,
                       help="request rates to sweep (requests/s; inf sends all at once; "
                       "required, no default)")
        g.add_argument("--sweep-pause", type=float, default=0.0,
                       help="seconds to wait between rates")
    else:
        g.add_argument("--rate", type=positive_rate, default=math.inf,
                       help="request rate (requests/s); inf sends all at once")
    g.add_argument("--arrival", choices=PROCESSES, default="poisson",
                   help="arrival process")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape for --arrival gamma (<1 burstier, >1 steadier)")
    g.add_argument("--ramp-from", type=float, default=None,
                   help="start rate of a linear ramp to the rate (default: no ramp)")
    g.add_argument("--ramp-s", type=float, default=0.0, help="ramp length in seconds")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no cap)")
    g.add_argument("--duration", type=float, default=None,
                   help="stop sending after this many seconds (default: no limit)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="with --duration: seconds to wait for in-flight requests, then "
                   "cancel them")
    g.add_argument("--warmup-requests", type=int, default=0,
                   help="first N requests are sent but left out of the metrics")
    g.add_argument("--warmup-s", type=float, default=0.0,
                   help="requests sent in the first S seconds are left out of the metrics")


def workload_config(args: argparse.Namespace, num_requests: int) -> WorkloadConfig:
    """The workload the flags of ``add_workload_args`` describe (and ``--prompt-as``)."""
    def dist(mean: int, spread: float) -> LengthDist:
        return LengthDist(mean, args.len_dist, spread)

    return WorkloadConfig(
        dataset=args.dataset, num_requests=num_requests, seed=args.seed,
        input_len=dist(args.input_len, args.input_spread),
        output_len=dist(args.output_len or 128, args.output_spread), path=args.dataset_path,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        long_share=args.long_share, long_input_len=LengthDist(args.long_input_len),
        long_output_len=LengthDist(args.long_output_len),
        sharegpt_output_from_file=args.output_len is None, vocab_size=args.vocab_size,
        with_text=args.prompt_as == "text")


def arrival_config(args: argparse.Namespace, rate: float) -> ArrivalConfig:
    """The arrivals the flags of ``add_arrival_args`` describe, at ``rate``."""
    if args.burstiness != 1.0 and args.arrival != "gamma":
        raise ValueError("--burstiness needs --arrival gamma")
    return ArrivalConfig(
        rate=rate, process=args.arrival, burstiness=args.burstiness, ramp_from=args.ramp_from,
        ramp_s=args.ramp_s, max_concurrency=args.max_concurrency, duration_s=args.duration,
        warmup_requests=args.warmup_requests, warmup_s=args.warmup_s, seed=args.seed)


def request_count(args: argparse.Namespace, rates: list[float]) -> int:
    """--num-requests, or with only --duration a count the duration cannot run out of."""
    if args.num_requests is not None:
        return int(args.num_requests)
    if args.duration is None:
        return DEFAULT_REQUESTS
    top = max([*rates, args.ramp_from or 0.0])
    if math.isinf(top):
        if args.max_concurrency is None:
            raise ValueError("--duration at an infinite rate needs --max-concurrency or "
                             "--num-requests")
        return 1_000_000  # a closed loop until the duration ends; specs are reused
    return math.ceil(top * args.duration * 1.5) + 16
