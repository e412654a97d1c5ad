"""The cost of the network between prefill and decode: TTFT, and how much of the KV
transfer is exposed (not hidden behind the prefill's compute), over rate-limited links,
with layer-wise shipping on and off.

The stack runs on the network-namespace hosts of services/bench/netns.py (as tests/netns
does): Redis, the router, a prefill worker (core 0) and a decode worker (core 1), each
on a host of its own on a bridge, with a deployment's credentials. Every host's link is
limited to each rate in turn (tbf; a delay too where the kernel has netem). Requests go
one at a time, each with a fresh prompt (no prefix cache hits, the whole KV crosses), at
about 1k tokens and at the longest prompt the served context allows, rates rotating
within each round. Then the prefill worker is restarted with layer-wise shipping off
(`--no-kv-layerwise`: each step's layers leave after its forward pass) and the same is
measured again.

The first token comes from the prefill worker; the transfer's exposed part (first KV byte
to last, less what overlapped the prefill's compute) is what the decode worker waits
before its first step, so it shows in the time from the first token to the second. It is
reported as a share of TTFT, the yardstick of the goal it serves.

Needs root and iproute2 (like `make test-netns`).

    python benchmarks/network_cost.py --rounds 3 --json bench-results/network_cost.json \\
        --plot docs/benchmarks/network_cost.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ["redis", "router", "prefill", "decode"]
RATES_GBIT = (1, 10, 25)
OVERLAP = ("on", "off")


async def one_request(stack: Any, ids: list[int], max_tokens: int) -> dict[str, float]:
    """Client TTFT and time from the first token to the second, with the server's
    timings of the request."""
    from services.api.client import build_request

    request = build_request(token_ids=ids, temperature=0.0, max_tokens=max_tokens,
                            ignore_eos=True)
    arrivals: list[float] = []
    timings: dict[str, float] = {}
    async with stack.client() as client:
        t0 = time.perf_counter()
        async for r in client.call(request, timeout=300):
            if r.HasField("chunk"):
                now = time.perf_counter() - t0
                arrivals += [now] * len(r.chunk.token_ids)
            elif r.HasField("final"):
                t = r.final.timings
                timings = {f.name: float(getattr(t, f.name)) for f in t.DESCRIPTOR.fields}
    if len(arrivals) < 2 or not timings:
        raise RuntimeError(f"an answer of {len(arrivals)} tokens, timings {timings}")
    exposed = max(0.0, timings["kv_transfer_s"] - timings["kv_transfer_hidden_s"])
    return {"ttft_s": arrivals[0], "second_token_gap_s": arrivals[1] - arrivals[0],
            "exposed_kv_s": exposed, **{f"server_{k}": v for k, v in timings.items()}}


def summarize(samples: list[dict[str, float]]) -> dict[str, float]:
    def med(key: str) -> float:
        return statistics.median(s[key] for s in samples)

    ttft, exposed = med("ttft_s"), med("exposed_kv_s")
    return {
        "requests": len(samples),
        "ttft_s": ttft,
        "second_token_gap_s": med("second_token_gap_s"),
        "prefill_s": med("server_prefill_s"),
        "kv_transfer_s": med("server_kv_transfer_s"),
        "kv_transfer_hidden_s": med("server_kv_transfer_hidden_s"),
        "exposed_kv_s": exposed,
        "exposed_share_of_ttft": statistics.median(
            s["exposed_kv_s"] / s["ttft_s"] for s in samples),
        "kv_bytes": med("server_kv_transfer_bytes"),
        "link_gbit_s_during_transfer": statistics.median(
            s["server_kv_transfer_bytes"] * 8 / 1e9 / s["server_kv_transfer_s"]
            for s in samples if s["server_kv_transfer_s"] > 0) if any(
            s["server_kv_transfer_s"] > 0 for s in samples) else 0.0,
    }


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from services.bench.netns import Fabric, unavailable
    from services.bench.netns_stack import NetStack
    from services.engine.model import prepare_default_model
    from tests.helpers.prompts import prompt_of_length

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"network namespaces are not available here: {reason}")
    tokenizer = AutoTokenizer.from_pretrained(str(prepare_default_model().path))
    fabric = Fabric.create(HOSTS)
    stack = NetStack(fabric, workdir)
    prefill_args = ("prefill", "0")
    samples: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    delayed = False
    try:
        stack.start_redis()
        stack.start_worker("prefill", *prefill_args)
        stack.start_worker("decode", "decode", "1", "--kv-transport", args.transport)
        stack.start_router()
        await stack.wait_ready(["prefill", "decode", "router"])
        async with stack.client() as client:
            context = (await client.model_info()).max_model_len
        lengths = [args.tokens, context - args.max_tokens]
        per_mode = (args.warmup + args.rounds * len(lengths) * len(args.rates))
        with tqdm(total=per_mode * len(args.overlap), desc="network cost") as bar:
            for overlap in args.overlap:
                if overlap == "off":
                    stack.stop("prefill")
                    stack.start_worker("prefill", *prefill_args, "--no-kv-layerwise")
                    await stack.wait_ready(["prefill"])
                for w in range(args.warmup):  # first-use costs, and the view of the router
                    ids = prompt_of_length(tokenizer, args.tokens, salt=f"warm {overlap} {w}")
                    await one_request(stack, ids, args.max_tokens)
                    bar.update()
                for r in range(args.rounds):
                    for gbit in args.rates:
                        for host in HOSTS:
                            delayed = fabric.shape(host, args.delay_ms, gbit * 1000)
                        for n in lengths:
                            ids = prompt_of_length(
                                tokenizer, n, salt=f"network cost {overlap} {gbit} {n} {r}")
                            samples.setdefault((overlap, gbit, n), []).append(
                                await one_request(stack, ids, args.max_tokens))
                            bar.update()
    finally:
        stack.close()
        fabric.close()
    cells = [{"overlap": o, "rate_gbit": g, "prompt_tokens": n, **summarize(s)}
             for (o, g, n), s in sorted(samples.items(), key=lambda kv: (
                 kv[0][2], kv[0][1], OVERLAP.index(kv[0][0])))]
    return {"transport": args.transport, "rounds": args.rounds, "max_tokens": args.max_tokens,
            "prompt_tokens": lengths, "context": context, "rates_gbit": list(args.rates),
            "link_delay_ms": args.delay_ms if delayed else 0.0,
            "qdisc": "netem" if delayed else "tbf", "cells": cells}


def table(summary: dict[str, Any]) -> str:
    rows = ["| prompt | link | overlap | TTFT p50 | exposed KV | exposed / TTFT | "
            "1st->2nd token | KV on the wire |",
            "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for c in summary["cells"]:
        rows.append(
            f"| {c['prompt_tokens']} | {c['rate_gbit']} Gbit/s | {c['overlap']} | "
            f"{c['ttft_s']:.2f} s | {c['exposed_kv_s'] * 1000:.0f} ms | "
            f"{c['exposed_share_of_ttft']:.1%} | {c['second_token_gap_s'] * 1000:.0f} ms | "
            f"{c['link_gbit_s_during_transfer']:.2f} Gbit/s |")
    return "\n".join(rows)


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = summary["prompt_tokens"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(8, 3.4), sharey=True)
    for ax, n in zip(axes, lengths, strict=True):
        for overlap, style in (("on", "o-"), ("off", "s--")):
            cells = [c for c in summary["cells"]
                     if c["prompt_tokens"] == n and c["overlap"] == overlap]
            ax.plot([c["rate_gbit"] for c in cells],
                    [100 * c["exposed_share_of_ttft"] for c in cells], style,
                    label=f"layer-wise {overlap}")
        ax.axhline(10, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xticks(summary["rates_gbit"], [str(g) for g in summary["rates_gbit"]])
        ax.set_xlabel("link rate, Gbit/s (tbf)")
        ax.set_title(f"{n}-token prompts", fontsize=9)
    axes[0].set_ylabel("exposed KV transfer, % of TTFT")
    axes[0].legend(fontsize=8)
    fig.suptitle("The cost of the network: exposed KV transfer (medians; dotted: 10%)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000,
                        help="the shorter prompt (the longer one fills the context)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measured requests per prompt length, link rate and mode")
    parser.add_argument("--warmup", type=int, default=1,
                        help="unmeasured requests after each prefill worker starts")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per answer")
    parser.add_argument("--rates", type=int, nargs="+", default=list(RATES_GBIT),
                        help="link rates, Gbit/s")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="link delay each way (only where the kernel has netem)")
    parser.add_argument("--transport", choices=["grpc", "torch", "nixl"], default="grpc",
                        help="how the KV travels to the decode worker")
    parser.add_argument("--overlap", nargs="+", choices=OVERLAP, default=list(OVERLAP),
                        help="layer-wise shipping modes to measure, in this order "
                        "(default: on off)")
    parser.add_argument("--json", default="", help="write the summary here as JSON")
    parser.add_argument("--plot", default="", help="write the exposed shares here (PNG)")
    args = parser.parse_args()
    # The services run as `python -m ...` in the hosts: this repository is on their path
    # wherever the benchmark is started from.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="pdserve-network-cost-") as tmp:
        try:
            summary = asyncio.run(run(args, Path(tmp)))
        except BaseException:
            for log in sorted(Path(tmp).glob("*.log")):
                print(f"--- {log.name}\n" + "\n".join(
                    log.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
            raise
    print(table(summary))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(summary, args.plot)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    cli()
