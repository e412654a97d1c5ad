"""The servers a benchmark can drive, behind one async interface.

``Target.stream(spec, request_id)`` sends one request and yields a ``ChunkEvent`` for
every streamed chunk, stamped with ``time.perf_counter()`` the moment it is received, then
one ``FinalEvent``; a failed request raises ``TargetError`` with a status code. Two
targets: pdserve's gRPC ``Generate`` and any OpenAI-compatible ``/v1/completions``
endpoint with ``stream: true`` (``vllm serve``, SGLang, TGI's OpenAI layer, ...).

Load goes only to loopback addresses or to hosts the user named explicitly: a load test
pointed at the wrong host is a denial of service.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import grpc

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services.security.tls import TLSFiles, channel_credentials
from services.traffic.record import ServerTimings
from services.traffic.request import RequestSpec

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # gRPC's default receive limit is only 4 MiB
PROMPT_MODES = ("token-ids", "text")


@dataclass(slots=True)
class ChunkEvent:
    time: float  # perf_counter() at receipt
    tokens: int  # tokens in this chunk; 0 where the protocol does not say


@dataclass(slots=True)
class FinalEvent:
    time: float  # perf_counter() at receipt of the final message / end of stream
    finish_reason: str
    completion_tokens: int | None  # from the server's usage, None when it sent none
    cached_tokens: int = 0
    timings: ServerTimings | None = None


Event = ChunkEvent | FinalEvent


class TargetError(Exception):
    """A request that failed; ``code`` is what the error tables group by."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message


class Target(Protocol):
    name: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def served_model(self) -> str:
        """The model the server serves (``--model`` when given); after ``start``."""
        ...

    def stream(self, spec: RequestSpec, request_id: str) -> AsyncIterator[Event]: ...


def check_host(host: str | None, allowed: Sequence[str] = ()) -> None:
    """Refuse any host that is neither loopback nor explicitly allowed."""
    if not host:
        raise ValueError("no host in the target address")
    if host in allowed or host == "localhost":
        return
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(
        f"refusing to send load to {host!r}: only loopback addresses or hosts named with "
        "--allow-host are targets")


class GrpcTarget:
    """pdserve's public gRPC API (pdserve.v1.GenerationService/Generate)."""

    name = "pdserve"

    def __init__(self, address: str, *, model: str = "", allowed_hosts: Sequence[str] = (),
                 timeout_s: float | None = None, prompt_mode: str = "token-ids",
                 num_channels: int = 1, api_key: str = "", tls: TLSFiles | None = None) -> None:
        check_host(urlsplit("//" + address).hostname, allowed_hosts)
        self.address, self.model, self.timeout_s = address, model, timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.tls = tls
        self.prompt_mode = prompt_mode
        self.num_channels = num_channels
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[generate_pb2_grpc.GenerationServiceStub] = []
        self._next = 0

    async def start(self) -> None:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Long generations keep a stream open for minutes: ping rather than let an
            # idle-looking connection be dropped by a proxy.
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            # Separate TCP connections per channel (gRPC would otherwise share one).
            ("grpc.use_local_subchannel_pool", 1),
        ]
        for _ in range(self.num_channels):
            channel = (grpc.aio.secure_channel(self.address, channel_credentials(self.tls),
                                               options) if self.tls is not None
                       else grpc.aio.insecure_channel(self.address, options=options))
            self._channels.append(channel)
            self._stubs.append(generate_pb2_grpc.GenerationServiceStub(channel))

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()

    async def served_model(self) -> str:
        if not self.model:
            info = await self._stubs[0].GetModelInfo(
                generate_pb2.GetModelInfoRequest(), timeout=self.timeout_s,
                metadata=self.metadata)
            self.model = info.model
        return self.model

    async def served_max_model_len(self) -> int | None:
        """The served model's context (prompt + output tokens); after ``start``."""
        info = await self._stubs[0].GetModelInfo(
            generate_pb2.GetModelInfoRequest(), timeout=self.timeout_s, metadata=self.metadata)
        return int(info.max_model_len) or None

    def _request(self, spec: RequestSpec, request_id: str) -> generate_pb2.GenerateRequest:
        sampling = generate_pb2.SamplingParams(
            max_tokens=spec.output_len, ignore_eos=True, temperature=0.0)
        request = generate_pb2.GenerateRequest(
            request_id=request_id, model=self.model, sampling=sampling)
        if self.prompt_mode == "text":
            request.text = spec.prompt_text
        else:
            request.token_ids.ids.extend(spec.prompt_ids)
        return request

    async def stream(self, spec: RequestSpec, request_id: str) -> AsyncIterator[Event]:
        stub = self._stubs[self._next % len(self._stubs)]
        self._next += 1
        call = stub.Generate(self._request(spec, request_id), timeout=self.timeout_s,
                             metadata=self.metadata)
        final_seen = False
        try:
            # Read to the end of the stream even after the final message, so the call
            # closes with the server's status instead of a client-side cancel.
            async for response in call:
                now = time.perf_counter()
                if response.HasField("chunk"):
                    yield ChunkEvent(now, len(response.chunk.token_ids))
                elif response.HasField("final"):
                    final_seen = True
                    yield _final_from_proto(now, response.final)
            if not final_seen:
                raise TargetError("INCOMPLETE_STREAM", "stream ended without a final message")
        except grpc.aio.AioRpcError as exc:
            raise TargetError(exc.code().name, exc.details() or "") from None
        finally:
            if not call.done():  # cancelled by the runner (duration limit): abort server-side
                call.cancel()


def _final_from_proto(now: float, final: generate_pb2.Final) -> FinalEvent:
    reason = generate_pb2.FinishReason.Name(final.finish_reason)
    timings = None
    if final.HasField("timings"):
        timings = ServerTimings(
            **{name: getattr(final.timings, name) for name in ServerTimings.field_names()})
    usage = final.usage if final.HasField("usage") else None
    return FinalEvent(
        time=now,
        finish_reason=reason.removeprefix("FINISH_REASON_").lower(),
        completion_tokens=usage.completion_tokens if usage is not None else None,
        cached_tokens=usage.cached_tokens if usage is not None else 0,
        timings=timings,
    )


class OpenAITarget:
    """Any OpenAI-compatible server: POST /v1/completions with ``stream: true`` (SSE)."""

    name = "openai"

    def __init__(self, base_url: str, *, model: str = "", allowed_hosts: Sequence[str] = (),
                 timeout_s: float | None = None, prompt_mode: str = "token-ids",
                 extra_body: dict[str, Any] | None = None, api_key: str = "") -> None:
        check_host(urlsplit(base_url).hostname, allowed_hosts)
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model, self.timeout_s, self.prompt_mode = model, timeout_s, prompt_mode
        self.extra_body = extra_body or {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # the runner caps concurrency itself
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            trust_env=False,  # never route load through a proxy from the environment
            headers=self.auth,
        )
        if not self.model:  # as `vllm bench serve` does: the first model the server lists
            async with self._session.get(f"{self.base_url}/v1/models") as resp:
                resp.raise_for_status()
                self.model = (await resp.json())["data"][0]["id"]

    async def served_model(self) -> str:
        return self.model  # `start` asked the server when none was given

    async def served_max_model_len(self) -> int | None:
        """The context the server lists for the model (vLLM's ``max_model_len`` in
        ``GET /v1/models``), or None when it lists none; after ``start``."""
        assert self._session is not None, "start() first"
        async with self._session.get(f"{self.base_url}/v1/models") as resp:
            resp.raise_for_status()
            models = (await resp.json()).get("data") or []
        for entry in models:
            if entry.get("id") == self.model and entry.get("max_model_len"):
                return int(entry["max_model_len"])
        return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _payload(self, spec: RequestSpec) -> dict[str, Any]:
        prompt: str | list[int] = (
            spec.prompt_text if self.prompt_mode == "text" else spec.prompt_ids)
        return {
            "model": self.model, "prompt": prompt, "max_tokens": spec.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **self.extra_body,
        }

    async def stream(self, spec: RequestSpec, request_id: str) -> AsyncIterator[Event]:
        assert self._session is not None, "start() first"
        headers = {"X-Request-Id": request_id}
        finish, completion = "", None
        try:
            async with self._session.post(f"{self.base_url}/v1/completions",
                                          json=self._payload(spec), headers=headers) as resp:
                if resp.status != 200:
                    raise TargetError(f"HTTP {resp.status}", (await resp.text())[:500])
                async for raw in resp.content:
                    now = time.perf_counter()
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event names
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        yield FinalEvent(now, finish, completion)
                        return
                    try:
                        message = json.loads(data)
                    except ValueError:
                        raise TargetError(
                            "BAD_STREAM", data[:200].decode(errors="replace")) from None
                    if "error" in message:
                        raise TargetError("STREAM_ERROR", str(message["error"])[:500])
                    if choices := message.get("choices"):
                        # Like `vllm bench serve`: every choices chunk is a received chunk.
                        finish = choices[0].get("finish_reason") or finish
                        yield ChunkEvent(now, 0)
                    if usage := message.get("usage"):
                        completion = usage.get("completion_tokens")
        except TimeoutError:
            raise TargetError("TIMEOUT", f"no answer within {self.timeout_s} s") from None
        except aiohttp.ClientError as exc:
            raise TargetError(type(exc).__name__, str(exc)[:500]) from None
        raise TargetError("INCOMPLETE_STREAM", "stream ended without data: [DONE]")
