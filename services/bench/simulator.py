"""SIMULATED servers for testing the harness: no model, no engine, just paced streams.

Two simulators speak the real protocols: ``SimulatedGenerationServicer`` serves
pdserve's gRPC ``Generate``, and ``simulated_openai_app`` serves an OpenAI-compatible
``/v1/completions`` SSE stream. Both wait a simulated TTFT, then stream ``max_tokens``
made-up tokens at a fixed pace. They exist for the harness's tests and to measure the
harness's own ceiling (how much load one client process can drive); their numbers say
nothing about pdserve or vLLM.

Run one standalone: ``python -m services.bench.simulator --protocol grpc --port 50051``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from pdserve.v1 import generate_pb2, generate_pb2_grpc

SIMULATED_MODEL = "simulated"
_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20)]


@dataclass(slots=True, frozen=True)
class SimulatorConfig:
    ttft_s: float = 0.0  # simulated time to first token, plus prefill_s_per_token each
    prefill_s_per_token: float = 0.0
    tpot_s: float = 0.0  # pace between tokens; 0 streams as fast as possible
    tokens_per_chunk: int = 1
    fail_every: int = 0  # every Nth request is refused as overloaded; 0 never
    disaggregated: bool = False  # report a made-up router/KV/decode-queue anatomy
    vocab_size: int = 32000


async def _paced(cfg: SimulatorConfig, prompt_len: int, max_tokens: int,
                 ) -> AsyncIterator[tuple[int, int]]:
    """Yields (first token index, token count) per chunk on the simulated schedule; sleeps
    to absolute deadlines so the pace does not drift with the event loop's delays."""
    start = time.perf_counter()
    first_at = start + cfg.ttft_s + cfg.prefill_s_per_token * prompt_len
    await asyncio.sleep(max(0.0, first_at - time.perf_counter()))
    yield 0, 1
    # In the made-up disaggregated anatomy, the 2nd token waits for KV transfer + queue.
    gap = 3 * cfg.tpot_s if cfg.disaggregated else 0.0
    sent = 1
    while sent < max_tokens:
        count = min(cfg.tokens_per_chunk, max_tokens - sent)
        due = first_at + gap + (sent + count - 1) * cfg.tpot_s
        delay = due - time.perf_counter()
        await asyncio.sleep(delay if delay > 0 else 0)  # 0 still yields to other streams
        yield sent, count
        sent += count


def _timings(cfg: SimulatorConfig, received: float, first: float, last: float,
             ) -> generate_pb2.Timings:
    now = time.perf_counter()
    ttft, decode = first - received, last - first
    t = generate_pb2.Timings(ttft_s=ttft, decode_s=decode, e2e_s=now - received,
                             prefill_s=ttft)
    if cfg.disaggregated:
        t.router_queue_s, t.queue_s, t.prefill_s = 0.1 * ttft, 0.2 * ttft, 0.6 * ttft
        t.kv_transfer_s, t.kv_transfer_hidden_s = 3 * cfg.tpot_s, cfg.tpot_s
        t.decode_queue_s, t.kv_transfer_bytes = cfg.tpot_s, 1 << 20
    return t


class SimulatedGenerationServicer(generate_pb2_grpc.GenerationServiceServicer):
    """A SIMULATED pdserve GenerationService (see the module docstring)."""

    def __init__(self, cfg: SimulatorConfig) -> None:
        self.cfg = cfg
        self.requests = 0

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[
                           generate_pb2.GenerateResponse]:
        received = time.perf_counter()
        self.requests += 1
        if self.cfg.fail_every and self.requests % self.cfg.fail_every == 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "simulated overload")
        if not request.sampling.HasField("max_tokens") or request.sampling.max_tokens < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens: >= 1")
        prompt_len = len(request.token_ids.ids) or len(request.text.split())
        first = last = received
        async for index, count in _paced(self.cfg, prompt_len, request.sampling.max_tokens):
            last = time.perf_counter()
            first = last if index == 0 else first
            ids = [(index + k) % self.cfg.vocab_size for k in range(count)]
            yield generate_pb2.GenerateResponse(
                chunk=generate_pb2.Chunk(token_ids=ids, text=" t" * count))
        usage = generate_pb2.Usage(prompt_tokens=prompt_len,
                                   completion_tokens=request.sampling.max_tokens)
        yield generate_pb2.GenerateResponse(final=generate_pb2.Final(
            finish_reason=generate_pb2.FINISH_REASON_LENGTH, usage=usage,
            timings=_timings(self.cfg, received, first, last), request_id=request.request_id))

    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> generate_pb2.GetModelInfoResponse:
        return generate_pb2.GetModelInfoResponse(
            model=SIMULATED_MODEL, max_model_len=1 << 20, vocab_size=self.cfg.vocab_size,
            serving_mode="disaggregated" if self.cfg.disaggregated else "colocated")


async def start_grpc_simulator(cfg: SimulatorConfig, host: str = "127.0.0.1",
                               port: int = 0) -> tuple[grpc.aio.Server, int]:
    """Starts the SIMULATED gRPC server; returns it and the port it listens on."""
    server = grpc.aio.server(options=_OPTIONS)
    generate_pb2_grpc.add_GenerationServiceServicer_to_server(
        SimulatedGenerationServicer(cfg), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def simulated_openai_app(cfg: SimulatorConfig) -> web.Application:
    """A SIMULATED OpenAI-compatible server: /v1/models and streaming /v1/completions."""
    counter = {"requests": 0}

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": SIMULATED_MODEL}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        counter["requests"] += 1
        if cfg.fail_every and counter["requests"] % cfg.fail_every == 0:
            return web.json_response({"error": {"message": "simulated overload"}}, status=429)
        max_tokens = int(body.get("max_tokens") or 16)
        if not body.get("stream"):
            return web.json_response({"error": {"message": "only stream=true"}}, status=400)
        prompt = body.get("prompt", "")
        prompt_len = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": "cmpl-sim", "object": "text_completion", "model": SIMULATED_MODEL}
        async for index, count in _paced(cfg, prompt_len, max_tokens):
            done = index + count >= max_tokens
            choice = {"index": 0, "text": " t" * count, "finish_reason": "length" if done else None}
            await resp.write(_sse({**base, "choices": [choice], "usage": None}))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": prompt_len, "completion_tokens": max_tokens,
                     "total_tokens": prompt_len + max_tokens}
            await resp.write(_sse({**base, "choices": [], "usage": usage}))
        await resp.write(_sse("[DONE]"))
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


async def start_openai_simulator(cfg: SimulatorConfig, host: str = "127.0.0.1",
                                 port: int = 0) -> tuple[web.AppRunner, int]:
    """Starts the SIMULATED OpenAI server; returns its runner (``await runner.cleanup()``
    stops it) and the port it listens on."""
    runner = web.AppRunner(simulated_openai_app(cfg), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1])


async def _serve(args: argparse.Namespace) -> None:
    cfg = SimulatorConfig(ttft_s=args.ttft_s, prefill_s_per_token=args.prefill_s_per_token,
                          tpot_s=args.tpot_s, tokens_per_chunk=args.tokens_per_chunk,
                          fail_every=args.fail_every, disaggregated=args.disaggregated)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.protocol == "grpc":
        server, port = await start_grpc_simulator(cfg, args.host, args.port)
        print(f"simulated pdserve gRPC server listening on {args.host}:{port}", flush=True)
        await stop.wait()
        await server.stop(grace=1.0)
    else:
        runner, port = await start_openai_simulator(cfg, args.host, args.port)
        print(f"simulated OpenAI server listening on http://{args.host}:{port}", flush=True)
        await stop.wait()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A SIMULATED server for testing the bench harness "
                                "(no model: paced made-up tokens).")
    p.add_argument("--protocol", choices=("grpc", "openai"), default="grpc",
                   help="pdserve gRPC or OpenAI-compatible SSE (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default: 0)")
    p.add_argument("--ttft-s", type=float, default=0.0, help="simulated TTFT (default: 0)")
    p.add_argument("--prefill-s-per-token", type=float, default=0.0,
                   help="extra TTFT per prompt token (default: 0)")
    p.add_argument("--tpot-s", type=float, default=0.0,
                   help="seconds between tokens; 0 streams as fast as possible (default: 0)")
    p.add_argument("--tokens-per-chunk", type=int, default=1,
                   help="tokens per streamed chunk (default: 1)")
    p.add_argument("--fail-every", type=int, default=0,
                   help="refuse every Nth request as overloaded; 0 never (default: 0)")
    p.add_argument("--disaggregated", action="store_true",
                   help="report a made-up disaggregated anatomy (default: off)")
    asyncio.run(_serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
