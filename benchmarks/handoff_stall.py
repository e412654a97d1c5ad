"""What a KV handoff costs the streams already decoding on the decode worker.

One `pdserve serve --mode disagg` stack (prefill worker on core 0, decode worker on core
1, prefix caching off). `--streams` background streams decode long answers on the decode
worker (their short prompts are prefilled on the prefill worker and shipped, like every
request). The run alternates windows of `--window-s` seconds without and with handoffs;
in a handoff window, requests with `--handoff-tokens`-token prompts arrive at `--rate`
per second (Poisson, seeded): each is prefilled on the prefill worker, its KV shipped to
the decode worker (over `shm`, the same-host path, unless `--no-shm`), which admits it
into the running batch. Reported, per kind of window, side by side in one run: the
running streams' inter-token latency (client-side gaps between chunks, from token 3 on:
tokens 1-2 belong to a stream's own prefill and handoff) at p50/p99, their ratio
with/without handoffs, and the handed-off requests' own first gap (token 1 to token 2)
with the decode worker's side of it (`decode_queue_s`, which includes waiting for the
last KV byte) from their Final.

    python benchmarks/handoff_stall.py --json bench-results/handoff_stall.json \\
        --plot bench-results/handoff_stall.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Gaps:
    """Inter-token gaps, each stamped with the arrival time of its later chunk."""

    at: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)

    def add(self, t: float, gap: float) -> None:
        self.at.append(t)
        self.gap.append(gap)

    def within(self, windows: list[tuple[float, float]]) -> list[float]:
        return [g for t, g in zip(self.at, self.gap, strict=True)
                if any(a <= t < b for a, b in windows)]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


async def stream_forever(target: str, prompts: Any, max_tokens: int, gaps: Gaps,
                         stop: asyncio.Event) -> None:
    """One background stream: long answers, one after the other, until `stop`."""
    from services.api.client import PdserveClient, build_request

    async with PdserveClient(target) as client:
        while not stop.is_set():
            req = build_request(token_ids=next(prompts), temperature=0.0,
                                max_tokens=max_tokens, ignore_eos=True)
            last, n = 0.0, 0
            async for r in client.call(req):
                if not r.HasField("chunk"):
                    continue
                now = time.perf_counter()
                n += len(r.chunk.token_ids)
                if n >= 3:  # tokens 1-2: this stream's own prefill and handoff
                    gaps.add(now, now - last)
                last = now
                if stop.is_set():
                    break


async def handoff(target: str, ids: list[int], out: list[dict[str, float]]) -> None:
    from services.api.client import PdserveClient, build_request

    async with PdserveClient(target) as client:
        req = build_request(token_ids=ids, temperature=0.0, max_tokens=4, ignore_eos=True)
        times: list[float] = []
        timings: dict[str, float] = {}
        async for r in client.call(req):
            if r.HasField("chunk"):
                times.append(time.perf_counter())
            elif r.HasField("final"):
                t = r.final.timings
                timings = {f.name: float(getattr(t, f.name)) for f in t.DESCRIPTOR.fields}
        if len(times) >= 2:
            out.append({"first_gap_s": times[1] - times[0], **timings})


async def main(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from services.engine.model import prepare_default_model
    from tests.helpers.prompts import prompt_of_length
    from tests.helpers.servers import DisaggStack

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_default_model().path))
    stack = DisaggStack.create(log_dir / "handoff-stall.log", args.transport)
    stack.server.args += ["--no-enable-prefix-caching"]
    if args.no_shm:
        stack.server.args += ["--no-kv-shm"]
    stack.server.args += ["--pin-scheduler" if args.pin_scheduler else "--no-pin-scheduler"]
    stack.server.start()
    counter = iter(range(10**9))
    short = (prompt_of_length(tokenizer, args.stream_prompt_tokens, salt=f"stream {i}")
             for i in counter)
    rng = random.Random(args.seed)
    gaps = Gaps()
    handed: list[dict[str, float]] = []  # the handed-off requests, as they finish
    windows: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    try:
        await stack.server.wait_ready(timeout=900)
        stop = asyncio.Event()
        streams = [asyncio.create_task(stream_forever(stack.server.target, short,
                                                      args.stream_tokens, gaps, stop))
                   for _ in range(args.streams)]
        await asyncio.sleep(args.warmup_s)  # every stream past its own handoff
        pending: set[asyncio.Task[None]] = set()
        with tqdm(total=2 * args.pairs, desc="windows (off, on)") as bar:
            for i in range(2 * args.pairs):
                kind = "off" if i % 2 == 0 else "on"
                start = time.perf_counter()
                end = start + args.window_s
                while kind == "on" and time.perf_counter() < end:
                    await asyncio.sleep(rng.expovariate(args.rate))
                    ids = prompt_of_length(tokenizer, args.handoff_tokens,
                                           salt=f"handoff {next(counter)}")
                    task = asyncio.create_task(handoff(stack.server.target, ids,
                                                       handed))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                await asyncio.sleep(max(0.0, end - time.perf_counter()))
                windows[kind].append((start, time.perf_counter()))
                if kind == "on":  # the next quiet window starts once handoffs landed
                    await asyncio.gather(*pending)
                bar.update()
        stop.set()
        await asyncio.gather(*streams, return_exceptions=True)
    finally:
        stack.server.stop()
    off, on = gaps.within(windows["off"]), gaps.within(windows["on"])
    first = [h["first_gap_s"] for h in handed]
    queue = [h.get("decode_queue_s", 0.0) for h in handed]
    return {
        "transport": "shm" if not args.no_shm else args.transport,
        "pin_scheduler": args.pin_scheduler,
        "streams": args.streams, "handoff_tokens": args.handoff_tokens,
        "rate_per_s": args.rate, "window_s": args.window_s, "pairs": args.pairs,
        "handoffs": len(handed),
        "itl_without": {"n": len(off), "p50_s": pct(off, 50), "p99_s": pct(off, 99)},
        "itl_with": {"n": len(on), "p50_s": pct(on, 50), "p99_s": pct(on, 99)},
        "itl_p50_ratio": pct(on, 50) / pct(off, 50),
        "itl_p99_ratio": pct(on, 99) / pct(off, 99),
        "handoff_first_gap_s": {"p50": pct(first, 50), "p99": pct(first, 99),
                                "max": max(first, default=float("nan"))},
        "handoff_decode_queue_s_median": statistics.median(queue) if queue else None,
        "gaps": {"without": off, "with": on, "handoff_first": first},
    }


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("without", "running streams, no handoffs"),
                       ("with", "running streams, handoffs arriving"),
                       ("handoff_first", "handed-off request, token 1 -> 2")):
        values = sorted(v * 1000 for v in summary["gaps"][key])
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("gap between tokens (ms)")
    ax.set_ylabel("share of gaps")
    ax.set_title(f"{summary['streams']} decoding streams; {summary['handoff_tokens']}-token "
                 f"handoffs at {summary['rate_per_s']}/s over {summary['transport']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4, help="background decoding streams")
    parser.add_argument("--stream-tokens", type=int, default=400,
                        help="output tokens of each background answer")
    parser.add_argument("--stream-prompt-tokens", type=int, default=64,
                        help="prompt tokens of each background request")
    parser.add_argument("--handoff-tokens", type=int, default=1000,
                        help="prompt tokens of each handed-off request (its KV is shipped)")
    parser.add_argument("--rate", type=float, default=0.2,
                        help="handoffs per second in a handoff window (Poisson)")
    parser.add_argument("--window-s", type=float, default=30.0, help="seconds per window")
    parser.add_argument("--pairs", type=int, default=3, help="(without, with) window pairs")
    parser.add_argument("--warmup-s", type=float, default=10.0,
                        help="seconds before the first window")
    parser.add_argument("--seed", type=int, default=0, help="seed of the handoff arrivals")
    parser.add_argument("--transport", choices=["grpc", "torch"], default="grpc",
                        help="network KV transport (used when shm is off)")
    parser.add_argument("--no-shm", action="store_true",
                        help="ship KV over the network transport, not same-host shm")
    parser.add_argument("--pin-scheduler", action=argparse.BooleanOptionalAction, default=True,
                        help="keep each engine's scheduler process on its engine's core "
                        "(the server's default)")
    parser.add_argument("--json", default="", help="write the summary here as JSON")
    parser.add_argument("--plot", default="", help="write the ITL distributions here (PNG)")
    parser.add_argument("--log-dir", default="bench-results/logs",
                        help="where the server's log goes")
    args = parser.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(main(args, log_dir))
    brief = {k: v for k, v in summary.items() if k != "gaps"}
    print(json.dumps(brief, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if args.plot:
        plot(summary, args.plot)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    cli()
