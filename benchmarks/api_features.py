"""What the API's features cost on a disaggregated stack, each against its plain
counterpart, side by side in one run on one `pdserve serve --mode disagg` stack:

- `schema`: a chat answer under a JSON schema (structured outputs, xgrammar) vs the same
  question unconstrained: TTFT and ITL (the mean gap between tokens after the first);
- `adapter`: a LoRA adapter's answer (named as the request's `model`) vs the base
  model's, same prompts, fixed output length: TTFT and ITL;
- `n4`: one request with n=4 vs 4 requests for the same answers (same seeds): prompt
  tokens the prefill worker computed (after its prefix cache), KV bytes shipped to the
  decode worker, and the time until all four answers are complete.

Pairs alternate which side goes first, one request (or one group of four) at a time, so
neither side always meets a warmer machine. The adapter is written by the benchmark
(random weights, rank 8, q and v projections): what it costs, not what it says.

    python benchmarks/api_features.py --requests 8 --json bench-results/api_features.json \\
        --plot docs/benchmarks/api_features.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer"},
                         "hobbies": {"type": "array", "items": {"type": "string",
                                                                "maxLength": 30},
                                     "maxItems": 4}},
          "required": ["name", "age", "hobbies"]}
PEOPLE = ["a retired sailor", "a young chemist", "a jazz drummer", "a beekeeper",
          "a bus driver", "a chess coach", "a night-shift nurse", "a glassblower"]
TOPICS = ["the sea", "mountains", "old bridges", "the moon", "train stations", "gardens",
          "winter", "libraries"]
PREFILL_COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total")
KV_BYTES = "pdserve_kv_transfer_bytes_total"


async def timed(target: str, **request: Any) -> dict[str, Any]:
    """One streamed request: TTFT, ITL (mean gap after the first token), tokens per choice."""
    from services.api.client import PdserveClient, build_request

    start = time.perf_counter()
    first = last = 0.0
    tokens: dict[int, list[int]] = {}
    async with PdserveClient(target) as client:
        async for r in client.call(build_request(**request), timeout=600):
            if r.HasField("chunk") and r.chunk.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens.setdefault(r.chunk.index, []).extend(r.chunk.token_ids)
    n = sum(len(t) for t in tokens.values())
    return {"ttft_s": first - start, "itl_s": (last - first) / max(1, n - 1),
            "total_s": last - start, "tokens": tokens}


def counters(port: int, names: tuple[str, ...]) -> dict[str, float]:
    from tests.helpers.servers import scrape

    metrics = scrape(port)
    return {name: metrics.get(name, 0.0) for name in names}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def alternate(sides: dict[str, Any], count: int, bar: Any) -> dict[str, list[dict[str, Any]]]:
    """Run `sides[name](i)` for i < count, the two sides alternating which goes first."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    names = list(sides)
    for i in range(count):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name].append(await sides[name](i))
        bar.update(1)
    return out


def latency_summary(runs: dict[str, list[dict[str, Any]]], base: str, other: str
                    ) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for key in ("ttft_s", "itl_s"):
        s[key] = {name: median([r[key] for r in rs]) for name, rs in runs.items()}
        s[f"{key.removesuffix('_s')}_ratio"] = s[key][other] / s[key][base]
    return s


async def n4_pair(stack: Any, i: int, grouped: bool, max_tokens: int) -> dict[str, Any]:
    """n=4 in one request, or 4 requests with the seeds vLLM gives n's children: prompt
    tokens computed on the prefill worker, KV bytes shipped, time to the last token."""
    # Distinct prompts for the two sides: neither finds the other's blocks cached.
    chat = [("user", f"Write one sentence about {TOPICS[i % len(TOPICS)]} "
             f"({'group' if grouped else 'separate'} {i}).")]
    common = {"chat": chat, "temperature": 0.8, "max_tokens": max_tokens, "ignore_eos": True}
    before_p = counters(stack.prefill_metrics, PREFILL_COUNTERS)
    before_d = counters(stack.decode_metrics, (KV_BYTES,))
    start = time.perf_counter()
    if grouped:
        answers = [await timed(stack.server.target, n=4, seed=i, **common)]
    else:
        answers = list(await asyncio.gather(*(
            timed(stack.server.target, seed=i + k, **common) for k in range(4))))
    elapsed = time.perf_counter() - start
    after_p = counters(stack.prefill_metrics, PREFILL_COUNTERS)
    after_d = counters(stack.decode_metrics, (KV_BYTES,))
    prompt, hits = (after_p[k] - before_p[k] for k in PREFILL_COUNTERS)
    return {"prefill_tokens_computed": prompt - hits, "prompt_tokens": prompt,
            "kv_bytes": after_d[KV_BYTES] - before_d[KV_BYTES], "total_s": elapsed,
            "choices": sum(len(a["tokens"]) for a in answers)}


async def main(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from tqdm import tqdm

    from services.engine.model import resolve_model
    from tests.helpers.lora import write_adapter
    from tests.helpers.servers import DisaggStack

    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_adapter(Path(tmp) / "bench-lora", resolve_model("", "float32"), seed=0)
        stack = DisaggStack.create(log_dir / "api-features.log", "grpc",
                                   "--lora", f"bench={adapter}", "--max-loras", "2")
        stack.server.start()
        try:
            await stack.server.wait_ready(timeout=900)
            target = stack.server.target
            # First use of each path (xgrammar, the adapter) is not part of any figure.
            await timed(target, chat=[("user", "Hi")], max_tokens=4,
                        structured=_schema_pb())
            await timed(target, chat=[("user", "Hi")], max_tokens=4, model="bench")
            n = args.requests
            with tqdm(total=3 * n, desc="pairs") as bar:
                schema = await alternate({
                    "plain": lambda i: timed(target, chat=_person(i), temperature=0.0,
                                             max_tokens=args.max_tokens),
                    "schema": lambda i: timed(target, chat=_person(i), temperature=0.0,
                                              max_tokens=args.max_tokens,
                                              structured=_schema_pb()),
                }, n, bar)
                adapter_runs = await alternate({
                    "base": lambda i: timed(target, chat=_story(i), temperature=0.0,
                                            max_tokens=args.max_tokens, ignore_eos=True),
                    "adapter": lambda i: timed(target, chat=_story(i), model="bench",
                                               temperature=0.0, max_tokens=args.max_tokens,
                                               ignore_eos=True),
                }, n, bar)
                n4 = await alternate({
                    "separate": lambda i: n4_pair(stack, i, False, args.max_tokens),
                    "n4": lambda i: n4_pair(stack, i, True, args.max_tokens),
                }, n, bar)
        finally:
            stack.server.stop()
    n4_summary: dict[str, Any] = {}
    for key in ("prefill_tokens_computed", "kv_bytes", "total_s"):
        n4_summary[key] = {name: median([r[key] for r in rs]) for name, rs in n4.items()}
        n4_summary[f"{key}_ratio"] = n4_summary[key]["n4"] / n4_summary[key]["separate"]
    n4_summary["choices"] = {name: sum(r["choices"] for r in rs) for name, rs in n4.items()}
    return {
        "requests": args.requests, "max_tokens": args.max_tokens, "schema_json": SCHEMA,
        "schema": latency_summary(_drop_tokens(schema), "plain", "schema"),
        "adapter": latency_summary(_drop_tokens(adapter_runs), "base", "adapter"),
        "n4": n4_summary,
        "runs": {"schema": _drop_tokens(schema), "adapter": _drop_tokens(adapter_runs),
                 "n4": n4},
    }


def _schema_pb() -> Any:
    from pdserve.v1 import generate_pb2 as pb

    return pb.StructuredOutput(json_schema=json.dumps(SCHEMA))


def _person(i: int) -> list[tuple[str, str]]:
    return [("user", f"Describe {PEOPLE[i % len(PEOPLE)]} as JSON with name, age and "
             f"hobbies. ({i})")]


def _story(i: int) -> list[tuple[str, str]]:
    return [("user", f"Tell a short story about {TOPICS[i % len(TOPICS)]}. ({i})")]


def _drop_tokens(runs: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    return {name: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
            for name, rs in runs.items()}


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [("schema TTFT", summary["schema"]["ttft_ratio"]),
            ("schema ITL", summary["schema"]["itl_ratio"]),
            ("adapter TTFT", summary["adapter"]["ttft_ratio"]),
            ("adapter ITL", summary["adapter"]["itl_ratio"]),
            ("n=4 prefill tokens", summary["n4"]["prefill_tokens_computed_ratio"]),
            ("n=4 KV bytes", summary["n4"]["kv_bytes_ratio"]),
            ("n=4 time to last token", summary["n4"]["total_s_ratio"])]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.barh([b[0] for b in bars][::-1], [b[1] for b in bars][::-1], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0, max(b[1] for b in bars) * 1.15)  # room for the labels
    for y, (_, v) in enumerate(bars[::-1]):
        ax.annotate(f"{v:.2f}x", (v, y), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_xlabel("feature / plain counterpart (median of pairs; 1 = no cost)")
    ax.set_title("What the API's features cost, side by side", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8,
                        help="pairs per comparison (each pair: the feature and its plain "
                        "counterpart)")
    parser.add_argument("--max-tokens", type=int, default=48, help="output tokens per answer")
    parser.add_argument("--json", default="", help="write the summary here as JSON")
    parser.add_argument("--plot", default="", help="write the ratios here (PNG)")
    parser.add_argument("--log-dir", default="bench-results/logs",
                        help="where the server's log goes")
    args = parser.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(main(args, log_dir))
    print(json.dumps({k: summary[k] for k in ("schema", "adapter", "n4")}, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if args.plot:
        plot(summary, args.plot)


if __name__ == "__main__":
    cli()
