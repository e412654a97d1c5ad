"""A small typed async client for the public gRPC API.

    async with PdserveClient("127.0.0.1:50051") as client:
        async for piece in client.stream(text="Hello", max_tokens=32, temperature=0):
            print(piece.text, end="")
        result = await client.generate(chat=[("user", "What is the capital of France?")])
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc
from services.security.tls import TLSFiles, channel_credentials
from services.server.channels import MAX_MESSAGE_BYTES, grpc_options
from services.wire import FINISH_NAMES


@dataclass(slots=True)
class Piece:
    """One streamed chunk."""

    token_ids: list[int]
    text: str


@dataclass(slots=True)
class Completion:
    """A whole answer, with the server's final message."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    chunks: int = 0


def build_request(
    text: str | None = None,
    chat: Sequence[tuple[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    *,
    model: str = "",
    request_id: str = "",
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one prompt form plus sampling fields
    (temperature, top_p, top_k, max_tokens, stop, seed, ... as in the proto)."""
    req = pb.GenerateRequest(model=model, request_id=request_id)
    if sum(x is not None for x in (text, chat, token_ids)) != 1:
        raise ValueError("give exactly one of text, chat, token_ids")
    if text is not None:
        req.text = text
    elif chat is not None:
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in chat)
    else:
        assert token_ids is not None
        req.token_ids.ids.extend(token_ids)
    req.sampling.CopyFrom(pb.SamplingParams(**sampling))
    return req


class PdserveClient:
    """A client of the public API. `api_key` is sent as `authorization: Bearer <key>` on
    every call; `tls` makes the channel TLS (its `ca`: the server's CA, the system's roots
    when unset; its `cert`/`key`: a client certificate for mTLS). `channel` replaces the
    channel altogether (e.g. `services.server.channels.dial` for a worker's internal port)."""

    def __init__(self, target: str = "127.0.0.1:50051",
                 max_message_bytes: int = MAX_MESSAGE_BYTES, *, api_key: str = "",
                 tls: TLSFiles | None = None, channel: grpc.aio.Channel | None = None) -> None:
        # pdserve's channel options: among them a short reconnect backoff, so a client
        # that starts before its server does not keep failing long after it is up.
        options = grpc_options(max_message_bytes)
        if channel is not None:
            self.channel = channel
        elif tls is not None:
            self.channel = grpc.aio.secure_channel(target, channel_credentials(tls), options)
        else:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    async def __aenter__(self) -> PdserveClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def call(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> grpc.aio.UnaryStreamCall:
        """The raw streaming call (cancel it with `.cancel()`)."""
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    async def stream(
        self, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[Piece]:
        """Yield the answer's pieces; raises grpc.aio.AioRpcError on error."""
        async for response in self.call(build_request(*args, **kwargs), timeout):
            if response.HasField("chunk"):
                yield Piece(list(response.chunk.token_ids), response.chunk.text)

    async def generate(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Completion:
        return await collect(self.call(build_request(*args, **kwargs), timeout))

    async def model_info(self, timeout: float | None = 10.0) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout,
                                            metadata=self.metadata)

    async def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    async def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait until the server's health says SERVING."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                if await self.health() == "SERVING":
                    return
            except grpc.aio.AioRpcError:
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout:.0f} s")
            await asyncio.sleep(0.5)


async def collect(call: AsyncIterator[pb.GenerateResponse]) -> Completion:
    text: list[str] = []
    ids: list[int] = []
    chunks = 0
    async for response in call:
        if response.HasField("chunk"):
            chunks += 1
            text.append(response.chunk.text)
            ids.extend(response.chunk.token_ids)
        elif response.HasField("final"):
            f = response.final
            timings = MessageToDict(f.timings, preserving_proto_field_name=True)
            return Completion(
                request_id=f.request_id,
                text="".join(text),
                token_ids=ids,
                finish_reason=FINISH_NAMES.get(f.finish_reason, "unspecified"),
                stop_reason=f.stop_reason,
                prompt_tokens=f.usage.prompt_tokens,
                completion_tokens=f.usage.completion_tokens,
                cached_tokens=f.usage.cached_tokens,
                timings={k: float(v) for k, v in timings.items()},
                chunks=chunks,
            )
    raise RuntimeError("the stream ended without a final message")
