"""TTFT of disaggregated serving against colocated vLLM at one prompt length, and what
the KV transfer costs, measured side by side in one run.

Started together, on this machine's cores:
  * colocated, all cores    (`pdserve serve --mode colocated`)
  * colocated, one core     (the same compute the prefill worker has)
  * disaggregated           (`pdserve serve --mode disagg`: prefill on core 0, decode on 1)
Requests go one at a time, rotating over the three, each with a fresh prompt (no prefix
cache hits). From the disaggregated answers' server-side anatomy it also reports the KV
transfer's duration, its share of the prefill time, and how much of it was hidden
behind prefill compute.

    python benchmarks/disagg_ttft.py --tokens 1000 --rounds 8 --transport grpc \\
        --json bench-results/disagg_ttft.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


async def ttft(target: str, ids: list[int], max_tokens: int) -> tuple[float, dict[str, float]]:
    from services.api.client import PdserveClient, build_request

    async with PdserveClient(target) as client:
        t0 = time.perf_counter()
        first = 0.0
        timings: dict[str, float] = {}
        req = build_request(token_ids=ids, temperature=0.0, max_tokens=max_tokens,
                            ignore_eos=True)
        async for r in client.call(req):
            if r.HasField("chunk") and not first:
                first = time.perf_counter() - t0
            elif r.HasField("final"):
                t = r.final.timings
                timings = {f.name: float(getattr(t, f.name)) for f in t.DESCRIPTOR.fields}
        return first, timings


async def main(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from services.engine.model import prepare_default_model
    from tests.helpers.prompts import prompt_of_length
    from tests.helpers.servers import DisaggStack, ServerProcess

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_default_model().path))
    common = ["--kv-cache-gib", "1", "--no-enable-prefix-caching"]
    servers = {
        "colocated_all_cores": ServerProcess(["--mode", "colocated", *common],
                                             log_dir / "colocated-all.log"),
        "colocated_one_core": ServerProcess(["--mode", "colocated", "--cpu-cores", "0",
                                             *common], log_dir / "colocated-one.log"),
    }
    stack = DisaggStack.create(log_dir / "disagg.log", args.transport)
    stack.server.args += ["--no-enable-prefix-caching"]
    servers["disaggregated"] = stack.server
    for s in servers.values():
        s.start()
    try:
        for s in servers.values():
            await s.wait_ready(timeout=900)
        results: dict[str, list[float]] = {name: [] for name in servers}
        anatomy: list[dict[str, float]] = []
        total = (args.warmup + args.rounds) * len(servers)
        with tqdm(total=total, desc=f"TTFT at {args.tokens} prompt tokens") as bar:
            for i in range(args.warmup + args.rounds):
                for name, server in servers.items():
                    ids = prompt_of_length(tokenizer, args.tokens, salt=f"{name} {i}")
                    value, timings = await ttft(server.target, ids, args.max_tokens)
                    if i >= args.warmup:
                        results[name].append(value)
                        if name == "disaggregated":
                            anatomy.append(timings)
                    bar.update()
    finally:
        for s in servers.values():
            s.stop()
    med = {name: statistics.median(v) for name, v in results.items()}

    def m(key: str) -> float:
        return statistics.median(t[key] for t in anatomy)

    return {
        "prompt_tokens": args.tokens, "rounds": args.rounds, "transport": args.transport,
        "ttft_median_s": med,
        "ttft_ratio_disagg_vs_colocated_all_cores":
            med["disaggregated"] / med["colocated_all_cores"],
        "ttft_ratio_disagg_vs_colocated_one_core":
            med["disaggregated"] / med["colocated_one_core"],
        "kv_transfer_bytes": m("kv_transfer_bytes"),
        "kv_transfer_s_median": m("kv_transfer_s"),
        "kv_transfer_hidden_s_median": m("kv_transfer_hidden_s"),
        "prefill_s_median": m("prefill_s"),
        "transfer_share_of_prefill": m("kv_transfer_s") / m("prefill_s"),
        "exposed_transfer_share_of_prefill":
            (m("kv_transfer_s") - m("kv_transfer_hidden_s")) / m("prefill_s"),
        "decode_queue_s_median": m("decode_queue_s"),
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000, help="prompt length in tokens")
    parser.add_argument("--rounds", type=int, default=8, help="measured requests per server")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    parser.add_argument("--transport", choices=["grpc", "torch"], default="grpc",
                        help="KV transport of the disaggregated pair")
    parser.add_argument("--json", default="", help="write the summary here as JSON")
    parser.add_argument("--log-dir", default="bench-results/logs",
                        help="where the servers' logs go")
    args = parser.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(main(args, log_dir))
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    cli()
