"""What the gRPC API layer adds to TTFT and TPOT, against the same engine driven
in-process, measured side by side in one run.

One process hosts a vLLM engine and the pdserve gRPC server over it. Rounds alternate:
the same prompt is sent once straight to the engine (`AsyncLLM.generate` in-process)
and once through the API by a client in a separate process (so the client's own work
does not share the server's CPU time slice). Requests run one at a time, so the
difference is the API layer, not batching.

    python benchmarks/api_overhead.py --rounds 20 --json bench-results/api_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_WORDS = (32, 256, 1024)


def client_main(target: str, jobs: Any, results: Any) -> None:
    """Runs in its own process: one request per job, reports client-side TTFT/TPOT."""
    from services.api.client import PdserveClient, build_request

    async def run() -> None:
        async with PdserveClient(target) as client:
            await client.wait_ready()
            while (job := jobs.get()) is not None:
                ids, max_tokens = job
                req = build_request(token_ids=ids, temperature=0.0, max_tokens=max_tokens,
                                    ignore_eos=True)
                t0 = time.perf_counter()
                stamps = []
                async for r in client.call(req):
                    if r.HasField("chunk"):
                        stamps.append(time.perf_counter())
                results.put((stamps[0] - t0, (stamps[-1] - stamps[0]) / (max_tokens - 1)))

    asyncio.run(run())


async def direct(engine: Any, ids: list[int], max_tokens: int, rid: str) -> tuple[float, float]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    t0 = time.perf_counter()
    stamps = []
    async for out in engine.generate(ids, params, rid):
        if out.outputs[0].token_ids:
            stamps.append(time.perf_counter())
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / (max_tokens - 1)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from services.api.backend import ColocatedBackend
    from services.api.public import serve_public
    from services.engine.config import EngineConfig
    from services.engine.engine import Engine
    from services.server.settings import ServerConfig
    from tests.helpers.prompts import long_text
    from tests.helpers.servers import free_port

    engine = Engine(EngineConfig(kv_cache_gib=1.0, enable_prefix_caching=False))
    engine.start()
    port = free_port()
    stop = asyncio.Event()
    config = ServerConfig(host="127.0.0.1", port=port, metrics_port=0)
    server = asyncio.create_task(serve_public(config, ColocatedBackend(engine),
                                              "benchmark server", stop=stop))
    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    client = ctx.Process(target=client_main, args=(f"127.0.0.1:{port}", jobs, results))
    client.start()
    loop = asyncio.get_running_loop()
    rows: dict[str, dict[str, list[float]]] = {}
    total = args.rounds * len(PROMPT_WORDS)
    with tqdm(total=total, desc="rounds (direct + gRPC)") as bar:
        for words in PROMPT_WORDS:
            ids = engine.tokenizer.encode(long_text(words))
            row = rows.setdefault(str(len(ids)), {k: [] for k in
                                  ("direct_ttft", "grpc_ttft", "direct_tpot", "grpc_tpot")})
            for i in range(args.warmup + args.rounds):
                d = await direct(engine, ids, args.max_tokens, f"d{words}-{i}")
                jobs.put((ids, args.max_tokens))
                g = await loop.run_in_executor(None, results.get)
                if i >= args.warmup:
                    row["direct_ttft"].append(d[0])
                    row["direct_tpot"].append(d[1])
                    row["grpc_ttft"].append(g[0])
                    row["grpc_tpot"].append(g[1])
                    bar.update()
    jobs.put(None)
    client.join()
    stop.set()
    await server
    engine.shutdown()
    summary: dict[str, Any] = {"rounds": args.rounds, "max_tokens": args.max_tokens, "rows": {}}
    for n, row in rows.items():
        med = {k: statistics.median(v) for k, v in row.items()}
        summary["rows"][n] = {
            **{f"{k}_median_s": v for k, v in med.items()},
            "ttft_ratio": med["grpc_ttft"] / med["direct_ttft"],
            "tpot_ratio": med["grpc_tpot"] / med["direct_tpot"],
        }
    return summary


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds per prompt size")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--json", default="", help="write the summary here as JSON")
    args = parser.parse_args()
    summary = asyncio.run(main(args))
    print(f"{'prompt tokens':>13} {'TTFT direct':>12} {'TTFT gRPC':>10} {'ratio':>6} "
          f"{'TPOT direct':>12} {'TPOT gRPC':>10} {'ratio':>6}")
    for n, r in summary["rows"].items():
        print(f"{n:>13} {r['direct_ttft_median_s'] * 1e3:>10.1f}ms "
              f"{r['grpc_ttft_median_s'] * 1e3:>8.1f}ms {r['ttft_ratio']:>6.3f} "
              f"{r['direct_tpot_median_s'] * 1e3:>10.1f}ms "
              f"{r['grpc_tpot_median_s'] * 1e3:>8.1f}ms {r['tpot_ratio']:>6.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    cli()
