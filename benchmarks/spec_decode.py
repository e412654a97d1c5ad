"""What speculative decoding (vLLM's ngram proposer) on the decode worker buys, and where
it does not.

Two `pdserve serve --mode disagg` stacks run side by side in one run, the same in every
way except the decode worker's `--speculative-config` (ngram on one, off on the other).
Requests alternate between the two stacks, one at a time (`--concurrency` streams per
stack at once), each greedy with a fixed output length, for two workloads:
- `repetitive`: prompts that repeat themselves (lists, templated lines), whose answers
  continue the pattern: an ngram proposer's drafts come true there;
- `chat`: ordinary chat questions, whose answers rarely repeat the prompt.
Reported per workload and stack: time per output token after the first (TPOT: the
decode phase's mean gap, per request) at p50/p90, the ratio ngram/plain, and from the
decode worker's own counters (vLLM's `vllm:spec_decode_*`): the share of drafted tokens
accepted and the tokens each decode step produced (1 + accepted per draft). Both stacks'
outputs are compared token by token (greedy: they must be equal).

    python benchmarks/spec_decode.py --json bench-results/spec_decode.json \\
        --plot bench-results/spec_decode.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


def repetitive_prompts(n: int) -> list[list[tuple[str, str]]]:
    """Chat turns whose answers repeat the prompt's own text."""
    kinds = [
        "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig.",
        "Continue the sequence: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
        "Write the line 'SELECT id, name FROM users WHERE id = N;' for N from 1 to 8.",
        "Copy this text twice: The quick brown fox jumps over the lazy dog.",
    ]
    return [[("user", f"{kinds[i % len(kinds)]} ({i})")] for i in range(n)]


def chat_prompts(n: int) -> list[list[tuple[str, str]]]:
    topics = ["why the sky is blue", "how a bicycle stays upright", "what a compiler does",
              "why bread rises", "how tides work", "what a database index is"]
    return [[("user", f"Explain {topics[i % len(topics)]} in a few sentences. ({i})")]
            for i in range(n)]


async def one(target: str, chat: list[tuple[str, str]], max_tokens: int
              ) -> tuple[list[int], float]:
    """The answer's token ids and its TPOT (decode seconds per token after the first)."""
    from services.api.client import PdserveClient, build_request

    async with PdserveClient(target) as client:
        ids: list[int] = []
        first = last = 0.0
        async for r in client.call(build_request(chat=chat, temperature=0.0,
                                                 max_tokens=max_tokens, ignore_eos=True)):
            if r.HasField("chunk") and r.chunk.token_ids:
                last = time.perf_counter()
                first = first or last
                ids.extend(r.chunk.token_ids)
    return ids, (last - first) / max(1, len(ids) - 1)


def spec_counters(port: int) -> dict[str, float]:
    from tests.helpers.servers import scrape

    metrics = scrape(port)
    return {name: metrics.get(name, 0.0) for name in SPEC_COUNTERS}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


async def run_workload(stacks: dict[str, Any], prompts: list[list[tuple[str, str]]],
                       args: argparse.Namespace, bar: Any) -> dict[str, Any]:
    before = spec_counters(stacks["ngram"].decode_metrics)
    tpot: dict[str, list[float]] = {"plain": [], "ngram": []}
    mismatches = 0
    for start in range(0, len(prompts), args.concurrency):
        batch = prompts[start:start + args.concurrency]
        answers: dict[str, list[tuple[list[int], float]]] = {}
        # Alternate which stack goes first, so neither always meets a warmer machine.
        order = ["plain", "ngram"] if start // args.concurrency % 2 == 0 else ["ngram", "plain"]
        for name in order:
            answers[name] = list(await asyncio.gather(
                *(one(stacks[name].server.target, chat, args.max_tokens) for chat in batch)))
            tpot[name] += [t for _, t in answers[name]]
        mismatches += sum(a[0] != b[0] for a, b in zip(answers["plain"], answers["ngram"],
                                                       strict=True))
        bar.update(len(batch))
    after = spec_counters(stacks["ngram"].decode_metrics)
    drafts, drafted, accepted = (after[k] - before[k] for k in SPEC_COUNTERS)
    return {
        "requests": len(prompts),
        "tpot_p50_s": {k: pct(v, 50) for k, v in tpot.items()},
        "tpot_p90_s": {k: pct(v, 90) for k, v in tpot.items()},
        "tpot_p50_ratio_ngram_over_plain": pct(tpot["ngram"], 50) / pct(tpot["plain"], 50),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_draft_step": 1 + accepted / drafts if drafts else 1.0,
        "token_mismatches": mismatches,
        "tpot_s": tpot,
    }


async def main(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from tqdm import tqdm

    from tests.helpers.servers import DisaggStack

    # Both stacks on the same cores: requests alternate, so one stack works at a time.
    stacks = {"plain": DisaggStack.create(log_dir / "spec-plain.log", "grpc"),
              "ngram": DisaggStack.create(log_dir / "spec-ngram.log", "grpc",
                                          "--speculative-config", json.dumps(NGRAM))}
    for stack in stacks.values():
        stack.server.start()
    workloads = {"repetitive": repetitive_prompts(args.requests),
                 "chat": chat_prompts(args.requests)}
    try:
        await asyncio.gather(*(s.server.wait_ready(timeout=900) for s in stacks.values()))
        # One request each first: first-use costs are not part of any figure.
        await asyncio.gather(*(one(s.server.target, [("user", "Hi")], 8)
                               for s in stacks.values()))
        results = {}
        with tqdm(total=args.requests * len(workloads), desc="requests per stack") as bar:
            for name, prompts in workloads.items():
                results[name] = await run_workload(stacks, prompts, args, bar)
    finally:
        for stack in stacks.values():
            stack.server.stop()
    return {"speculative_config": NGRAM, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "workloads": results}


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["workloads"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for k, stack in enumerate(("plain", "ngram")):
        values = [summary["workloads"][n]["tpot_p50_s"][stack] * 1000 for n in names]
        ax.bar([i + (k - 0.5) * width for i in range(len(names))], values, width,
               label=f"decode {'with ngram' if stack == 'ngram' else 'plain'}")
    for i, n in enumerate(names):
        w = summary["workloads"][n]
        ax.annotate(f"x{w['tpot_p50_ratio_ngram_over_plain']:.2f}, "
                    f"{w['tokens_per_draft_step']:.2f} tok/step", (i, 0), xytext=(0, 4),
                    textcoords="offset points", ha="center", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("TPOT p50 (ms)")
    ax.set_title(f"ngram drafts on the decode worker, {summary['concurrency']} stream(s) "
                 "per stack", fontsize=10)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
    ax.legend(loc="upper center", ncol=2, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12, help="requests per workload and "
                        "stack")
    parser.add_argument("--max-tokens", type=int, default=96, help="output tokens per request")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight on a stack at once")
    parser.add_argument("--json", default="", help="write the summary here as JSON")
    parser.add_argument("--plot", default="", help="write the TPOT bars here (PNG)")
    parser.add_argument("--log-dir", default="bench-results/logs",
                        help="where the servers' logs go")
    args = parser.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(main(args, log_dir))
    brief = {name: {k: v for k, v in w.items() if k != "tpot_s"}
             for name, w in summary["workloads"].items()}
    print(json.dumps(brief, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if args.plot:
        plot(summary, args.plot)
    if any(w["token_mismatches"] for w in summary["workloads"].values()):
        sys.exit("greedy outputs differ between the two stacks")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    cli()
