"""Router overhead and capacity, with simulated workers.

The workers here are SIMULATORS, not engines: a simulated prefill worker answers
`Prefill` at once with a fixed first token; a simulated decode worker streams
`--tokens` tokens per request at a set pace. They register in a real redis-server like
real workers, so the real router (`pdserve router`, one process, pinned to one core)
routes to them exactly as it would to vLLM workers.

Measured in one run:
  * latency the router adds: TTFT and E2E through the router vs calling the simulated
    decode worker directly (p50, p99), one request at a time;
  * capacity: routed requests/s and streamed tokens/s with many concurrent clients,
    divided by the router's CPU time (so: per router core).

    python benchmarks/router_overhead.py --json bench-results/router_overhead.json

With `--security MODE` (repeatable), each mode gets its own router, measured one after
the other in the same run, and the summary holds each mode and its ratio to the first:
  plain  no credentials (the router on loopback);
  keys   API keys on the public port (every call carries `authorization: Bearer`);
  tls    TLS on the public port;
  all    API keys + TLS on the public port + mutual TLS from the router to the workers.

    python benchmarks/router_overhead.py --security plain --security keys \
        --security tls --security all --json bench-results/security_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.v1 import generate_pb2 as pb  # noqa: E402
from pdserve.v1 import worker_pb2 as wpb  # noqa: E402
from pdserve.v1 import worker_pb2_grpc as wpb_grpc  # noqa: E402


class SimulatedPrefillWorker(wpb_grpc.PrefillServiceServicer):
    """A simulator: answers at once, ships nothing."""

    async def Prefill(self, req: wpb.PrefillRequest, ctx: Any) -> wpb.PrefillResponse:
        return wpb.PrefillResponse(first_token_id=1, first_token_text="a",
                                   handle=wpb.TransferHandle(transfer_id=req.transfer_id,
                                                             decode_epoch=req.target.epoch))


class SimulatedDecodeWorker(wpb_grpc.DecodeServiceServicer):
    """A simulator: streams max_tokens tokens, one chunk each, `pace_s` apart."""

    def __init__(self, pace_s: float) -> None:
        self.pace_s = pace_s

    async def Decode(self, req: wpb.DecodeRequest, ctx: Any) -> AsyncIterator[pb.GenerateResponse]:
        chunk = pb.GenerateResponse(chunk=pb.Chunk(token_ids=[7], text="b"))
        for _ in range(req.sampling.max_tokens):
            if self.pace_s:
                await asyncio.sleep(self.pace_s)
            yield chunk
        yield pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH))


def simulated_workers(redis_url: str, pace_s: float, ready: Any,
                      internal_tls_dir: str = "") -> None:
    """Runs in its own process: one simulated prefill and one simulated decode worker
    (serving mutual TLS with the decode certificate of `internal_tls_dir` when given)."""
    from services.registry.records import WorkerRecord
    from services.registry.registry import Registry

    async def main() -> None:
        server = grpc.aio.server()
        wpb_grpc.add_PrefillServiceServicer_to_server(SimulatedPrefillWorker(), server)
        wpb_grpc.add_DecodeServiceServicer_to_server(SimulatedDecodeWorker(pace_s), server)
        from services.security import certs
        from services.server.ports import add_internal_port

        files = certs.internal_files(internal_tls_dir, "decode") if internal_tls_dir else None
        port = add_internal_port(server, "127.0.0.1:0", files)
        await server.start()
        registry = Registry.from_url(redis_url, ttl_s=30)
        common = dict(address=f"127.0.0.1:{port}", host="sim", epoch=1, fingerprint="sim",
                      capacity=100000, model="simulated", max_model_len=1 << 20,
                      vocab_size=49152, dtype="float32")
        for role in ("prefill", "decode"):
            await registry.heartbeat(WorkerRecord(worker_id=f"sim-{role}", role=role,
                                                  kv_address="127.0.0.1:1",
                                                  updated=time.time(), **common))
        ready.put(port)
        while True:  # keep the registrations alive
            await asyncio.sleep(5)
            for role in ("prefill", "decode"):
                await registry.heartbeat(WorkerRecord(worker_id=f"sim-{role}", role=role,
                                                      kv_address="127.0.0.1:1",
                                                      updated=time.time(), **common))

    asyncio.run(main())


def _request(tokens: int) -> pb.GenerateRequest:
    from services.api.client import build_request

    return build_request(token_ids=[1, 2, 3, 4, 5, 6, 7, 8], max_tokens=tokens,
                         temperature=0.0)


# Security of the router under test (--security): how clients reach it and the workers.
class Security:
    def __init__(self, mode: str = "plain", certs_dir: str = "") -> None:
        self.mode, self.certs_dir = mode, certs_dir
        self.key = "bench-key-0123456789abcdef"
        self.keys = mode in ("keys", "all")
        self.tls = mode in ("tls", "all")
        self.internal = mode == "all"

    def router_args(self) -> list[str]:
        from services.security import certs

        args: list[str] = []
        if self.keys:
            path = Path(self.certs_dir) / "api-keys"
            path.write_text(f"bench:{self.key}\n")
            args += ["--api-keys-file", str(path)]
        if self.tls:
            server = certs.public_files(self.certs_dir, "server")
            args += ["--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key)]
        if self.internal:
            own = certs.internal_files(self.certs_dir, "router")
            args += ["--internal-tls-ca-file", str(own.ca), "--internal-tls-cert-file",
                     str(own.cert), "--internal-tls-key-file", str(own.key)]
        return args

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.key}"),) if self.keys else ()

    def router_channel(self, address: str) -> grpc.aio.Channel:
        from services.security import certs
        from services.security.tls import TLSFiles, channel_credentials

        if not self.tls:
            return grpc.aio.insecure_channel(address)
        ca = certs.public_files(self.certs_dir, "server").ca
        return grpc.aio.secure_channel(address, channel_credentials(TLSFiles(ca=ca)))

    def worker_channel(self, address: str) -> grpc.aio.Channel:
        """The direct baseline: the worker as the router reaches it."""
        from services.security import certs
        from services.server.channels import dial

        files = certs.internal_files(self.certs_dir, "router") if self.internal else None
        return dial(address, files)


SECURITY = Security()


async def one(stub: Any, req: Any, direct: bool) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first = 0.0
    n = 0
    call = stub.Decode(req) if direct else stub.Generate(req, metadata=SECURITY.metadata)
    async for r in call:
        if r.HasField("chunk"):
            n += len(r.chunk.token_ids)
            if not first:
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, n


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def latency(router: str, worker: str, rounds: int, tokens: int) -> dict[str, float]:
    from pdserve.v1 import generate_pb2_grpc as pb_grpc

    routed: list[tuple[float, float, int]] = []
    direct: list[tuple[float, float, int]] = []
    async with SECURITY.router_channel(router) as rc, SECURITY.worker_channel(worker) as wc:
        gen, dec = pb_grpc.GenerationServiceStub(rc), wpb_grpc.DecodeServiceStub(wc)
        dreq = wpb.DecodeRequest(request_id="direct", prompt_token_ids=[1, 2, 3],
                                 sampling=pb.SamplingParams(max_tokens=tokens))
        for i in range(rounds + 20):
            r = await one(gen, _request(tokens), False)
            d = await one(dec, dreq, True)
            if i >= 20:
                routed.append(r)
                direct.append(d)
    out = {}
    for name, idx in (("ttft", 0), ("e2e", 1)):
        for q in (50, 99):
            added = pct([x[idx] for x in routed], q) - pct([x[idx] for x in direct], q)
            out[f"{name}_added_p{q}_ms"] = added * 1e3
            out[f"{name}_direct_p{q}_ms"] = pct([x[idx] for x in direct], q) * 1e3
    return out


async def capacity(router: str, concurrency: int, seconds: float, tokens: int,
                   router_pid: int) -> dict[str, float]:
    import psutil

    from pdserve.v1 import generate_pb2_grpc as pb_grpc

    proc = psutil.Process(router_pid)
    done = 0
    streamed = 0
    errors = 0
    stop = time.perf_counter() + seconds

    async def client(stub: Any) -> None:
        nonlocal done, streamed, errors
        while time.perf_counter() < stop:
            try:
                _, _, n = await one(stub, _request(tokens), False)
                done += 1
                streamed += n
            except grpc.aio.AioRpcError:
                errors += 1

    channels = [SECURITY.router_channel(router) for _ in range(8)]
    cpu0 = sum(proc.cpu_times()[:2])
    t0 = time.perf_counter()
    await asyncio.gather(*(client(pb_grpc.GenerationServiceStub(channels[i % 8]))
                           for i in range(concurrency)))
    wall = time.perf_counter() - t0
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    for c in channels:
        await c.close()
    return {"tokens_per_request": tokens, "concurrency": concurrency,
            "requests_per_s": done / wall, "tokens_per_s": streamed / wall,
            "router_cpu_s": cpu, "router_cpu_share": cpu / wall,
            "requests_per_router_core_s": done / cpu, "tokens_per_router_core_s": streamed / cpu,
            "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="latency: measured requests")
    parser.add_argument("--seconds", type=float, default=10.0, help="capacity: run length")
    parser.add_argument("--concurrency", type=int, default=64, help="capacity: clients")
    parser.add_argument("--router-core", type=int, default=0, help="core the router runs on")
    parser.add_argument("--json", default="", help="write the summary here as JSON")
    parser.add_argument("--security", action="append", default=[],
                        choices=("plain", "keys", "tls", "all"),
                        help="measure a router with this security (repeatable: each mode in "
                        "turn, in one run, with its ratio to the first); default: plain")
    args = parser.parse_args()
    # One cluster secret for the simulated workers' records and the router that reads them.
    os.environ.setdefault("PDSERVE_CLUSTER_SECRET", "router-overhead-benchmark-secret")
    modes = args.security or ["plain"]
    if len(modes) == 1 and modes[0] == "plain":
        summary = measure(args, Security())
    else:
        import tempfile

        from services.security import certs

        certs_dir = tempfile.mkdtemp(prefix="router-overhead-certs-")
        certs.init(certs_dir)
        summary = {mode: measure(args, Security(mode, certs_dir)) for mode in modes}
        summary["ratios"] = ratios(summary, modes)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))


def ratios(summary: dict[str, Any], modes: list[str]) -> dict[str, dict[str, float]]:
    """Each mode against the first: added latency (ms difference) and capacity (ratio)."""
    base = summary[modes[0]]
    out = {}
    for mode in modes[1:]:
        m = summary[mode]
        out[mode] = {
            "ttft_added_p50_ms_delta": m["latency"]["ttft_added_p50_ms"]
            - base["latency"]["ttft_added_p50_ms"],
            "ttft_routed_p50_ratio": (m["latency"]["ttft_added_p50_ms"]
                                      + m["latency"]["ttft_direct_p50_ms"])
            / (base["latency"]["ttft_added_p50_ms"] + base["latency"]["ttft_direct_p50_ms"]),
            "requests_per_router_core_s_ratio": m["capacity_short"]["requests_per_router_core_s"]
            / base["capacity_short"]["requests_per_router_core_s"],
            "tokens_per_router_core_s_ratio": m["capacity_stream"]["tokens_per_router_core_s"]
            / base["capacity_stream"]["tokens_per_router_core_s"],
        }
    return out


def measure(args: argparse.Namespace, security: Security) -> dict[str, Any]:
    global SECURITY
    SECURITY = security
    from services.registry.redis_server import RedisServer
    from tests.helpers.servers import free_port

    redis = RedisServer().start()
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    internal_dir = security.certs_dir if security.internal else ""
    sims = ctx.Process(target=simulated_workers, args=(redis.url, 0.0, ready, internal_dir),
                       daemon=True)
    sims.start()
    worker_port = ready.get(timeout=60)
    port, metrics = free_port(), free_port()
    router = subprocess.Popen(
        ["taskset", "-c", str(args.router_core), sys.executable, "-m", "services.cli",
         "--log-level", "WARNING", "router", "--redis-url", redis.url, "--host", "127.0.0.1",
         "--port", str(port), "--metrics-port", str(metrics), "--max-inflight", "100000",
         *security.router_args()],
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        async def run() -> dict[str, Any]:
            from services.api.client import PdserveClient

            address = f"127.0.0.1:{port}"
            async with PdserveClient(address, channel=SECURITY.router_channel(address)) as c:
                await c.wait_ready(120)
            lat = await latency(f"127.0.0.1:{port}", f"127.0.0.1:{worker_port}", args.rounds, 16)
            short = await capacity(f"127.0.0.1:{port}", args.concurrency, args.seconds, 1,
                                   router.pid)
            stream = await capacity(f"127.0.0.1:{port}", args.concurrency, args.seconds, 64,
                                    router.pid)
            return {"latency": lat, "capacity_short": short, "capacity_stream": stream}

        return asyncio.run(run())
    finally:
        router.terminate()
        router.wait(30)
        sims.terminate()
        redis.stop()


if __name__ == "__main__":
    main()
