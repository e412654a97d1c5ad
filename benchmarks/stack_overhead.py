"""Low-load cost of pdserve over plain vLLM: one request at a time, side by side.

Three servers run at once on the same machine; requests rotate over them one at a time
(so only one is ever busy), a fresh random prompt each time (prefix caching off):
  * vllm:       vLLM's own OpenAI server (what `vllm serve` runs), both cores;
  * colocated:  `pdserve serve --mode colocated`, the same engine settings, both cores;
  * full_stack: `pdserve up --prefill 1 --decode 1`: Ray, Redis, the router, a prefill
                worker on core 0 and a decode worker on core 1, KV over gRPC.
The two pdserve servers are measured through both their OpenAI HTTP API (the same
client code as against vLLM) and their gRPC API.

    python benchmarks/stack_overhead.py --rounds 8 --json bench-results/stack_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.targets import ChunkEvent, GrpcTarget, OpenAITarget, Target  # noqa: E402
from services.traffic.request import RequestSpec  # noqa: E402
from tests.helpers.servers import ServerProcess, free_port, stop_group  # noqa: E402

ENGINE_FLAGS = ["--kv-cache-gib", "1", "--no-enable-prefix-caching"]


class VllmServer:
    """vLLM's OpenAI-compatible server, started the way `vllm serve` starts it."""

    def __init__(self, model: Path, log: Path) -> None:
        self.port = free_port()
        cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model), "--served-model-name", "smollm2", "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--max-model-len", "2048",
               "--max-num-seqs", "64", "--enforce-eager", "--no-enable-prefix-caching",
               "--seed", "0"]
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited ({self.proc.returncode})")
            try:
                if urllib.request.urlopen(f"{self.base_url}/health", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError("vLLM's server did not start")

    def stop(self) -> None:
        stop_group(self.proc, timeout=60)


async def one(target: Target, spec: RequestSpec, rid: str) -> tuple[float, float]:
    """TTFT and TPOT of one request, seen by the client."""
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async for event in target.stream(spec, rid):
        if isinstance(event, ChunkEvent):
            first = first or event.time
            last = event.time
            tokens += event.tokens or 1
        else:
            tokens = event.completion_tokens or tokens
    assert first is not None and last is not None and tokens == spec.output_len, rid
    return first - start, (last - first) / (tokens - 1)


async def measure(targets: dict[str, Target], lengths: list[int], rounds: int,
                  output_len: int, vocab: int, pause_s: float) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    samples: dict[str, dict[str, dict[str, list[float]]]] = {
        str(n): {name: {"ttft": [], "tpot": []} for name in targets} for n in lengths}
    try:
        for name, target in targets.items():
            await target.start()
            await one(target, RequestSpec(rng.integers(100, vocab, 16).tolist(), 4),
                      f"warm-{name}")
        for r in range(rounds):
            for n in lengths:
                for name, target in targets.items():
                    # Engines keep working for a moment after a request (freeing blocks,
                    # the pair's KV acknowledgement, idle OpenMP threads spinning): let
                    # that settle so no server pays for the one before it.
                    await asyncio.sleep(pause_s)
                    spec = RequestSpec(rng.integers(100, vocab, n).tolist(), output_len)
                    ttft, tpot = await one(target, spec, f"{name}-{n}-{r}")
                    samples[str(n)][name]["ttft"].append(ttft)
                    samples[str(n)][name]["tpot"].append(tpot)
            print(f"round {r + 1}/{rounds} done", flush=True)
    finally:
        for target in targets.values():
            await target.close()
    medians = {n: {name: {k: statistics.median(v) for k, v in s.items()}
                   for name, s in per.items()} for n, per in samples.items()}
    return {"samples": samples, "median": medians}


def print_table(medians: dict[str, Any]) -> None:
    for n, per in medians.items():
        base = per["vllm"]
        print(f"\n{n} prompt tokens")
        for name, m in per.items():
            print(f"  {name:<22} TTFT {m['ttft'] * 1e3:8.1f} ms ({m['ttft'] / base['ttft']:.2f}x)"
                  f"  TPOT {m['tpot'] * 1e3:6.1f} ms ({m['tpot'] / base['tpot']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="requests per server and length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 1000],
                        help="prompt lengths in tokens")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per answer")
    parser.add_argument("--pause", type=float, default=2.0,
                        help="seconds of quiet before each request")
    parser.add_argument("--logs", default="bench-results/stack_overhead",
                        help="folder for the servers' logs")
    parser.add_argument("--json", default="bench-results/stack_overhead.json",
                        help="where the results go")
    args = parser.parse_args()

    from services.api.client import PdserveClient
    from services.engine.model import resolve_model

    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    model = resolve_model("", "float32")
    vllm = VllmServer(model, logs / "vllm.log")
    colocated = ServerProcess(["--mode", "colocated", *ENGINE_FLAGS], logs / "colocated.log")
    stack = ServerProcess(["--prefill", "1", "--decode", "1", *ENGINE_FLAGS],
                          logs / "full_stack.log", command="up")
    servers = [colocated, stack]
    try:
        for s in servers:
            s.start()

        async def ready() -> None:
            for s in servers:
                async with PdserveClient(s.target) as client:
                    await client.wait_ready(timeout=900)

        asyncio.run(ready())
        vllm.wait_ready()
        targets: dict[str, Target] = {
            "vllm": OpenAITarget(vllm.base_url),
            "colocated (HTTP)": OpenAITarget(f"http://127.0.0.1:{colocated.http_port}"),
            "colocated (gRPC)": GrpcTarget(colocated.target),
            "full_stack (HTTP)": OpenAITarget(f"http://127.0.0.1:{stack.http_port}"),
            "full_stack (gRPC)": GrpcTarget(stack.target),
        }
        result = asyncio.run(measure(targets, args.lengths, args.rounds, args.output_len,
                                     vocab=49152, pause_s=args.pause))
    finally:
        vllm.stop()
        for s in servers:
            s.stop()
    result["args"] = vars(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print_table(result["median"])
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
