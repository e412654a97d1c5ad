"""Runs that keep every token: which ids each request received, when, and how often the
server moved it (``Final.migrations``).

The ordinary `Runner` keeps chunk times and token counts, enough for latency metrics; a
fault-injection run also has to compare each answer token by token with an undisturbed
run and see where a stream moved. `TokenTarget` yields the ids with every chunk and the
migrations with the final message; `TokenRunner` keeps them beside the request records,
by the request's index in the schedule.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from services.bench.runner import Runner, _Run
from services.bench.targets import (
    ChunkEvent,
    Event,
    FinalEvent,
    GrpcTarget,
    TargetError,
    _final_from_proto,
)
from services.traffic.record import RequestRecord
from services.traffic.request import RequestSpec


@dataclass(slots=True)
class TokenChunk(ChunkEvent):
    ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class TokenFinal(FinalEvent):
    migrations: int = 0


@dataclass(slots=True)
class Tokens:
    """What one request received, beyond its `RequestRecord`."""

    ids: list[int] = field(default_factory=list)
    migrations: int = 0
    end_time: float = 0.0  # epoch seconds of the final message or the error


class TokenTarget(GrpcTarget):
    """pdserve's gRPC API, yielding token ids with each chunk and migrations at the end."""

    async def stream(self, spec: RequestSpec, request_id: str) -> AsyncIterator[Event]:
        stub = self._stubs[self._next % len(self._stubs)]
        self._next += 1
        call = stub.Generate(self._request(spec, request_id), timeout=self.timeout_s,
                             metadata=self.metadata)
        final_seen = False
        try:
            async for response in call:
                now = time.perf_counter()
                if response.HasField("chunk"):
                    ids = list(response.chunk.token_ids)
                    yield TokenChunk(now, len(ids), ids)
                elif response.HasField("final"):
                    final_seen = True
                    base = _final_from_proto(now, response.final)
                    yield TokenFinal(base.time, base.finish_reason, base.completion_tokens,
                                     base.cached_tokens, base.timings,
                                     int(response.final.migrations))
            if not final_seen:
                raise TargetError("INCOMPLETE_STREAM", "stream ended without a final message")
        except grpc.aio.AioRpcError as exc:
            raise TargetError(exc.code().name, exc.details() or "") from None
        finally:
            if not call.done():
                call.cancel()


class _Tap:
    """Wraps a target's stream to copy ids and migrations into a `Tokens`."""

    def __init__(self, target: TokenTarget, store: dict[int, Tokens]) -> None:
        self.target, self.store = target, store
        self.name = target.name

    async def start(self) -> None:
        await self.target.start()

    async def close(self) -> None:
        await self.target.close()

    async def stream(self, spec: RequestSpec, request_id: str) -> AsyncIterator[Event]:
        index = int(request_id.split("-")[-2])  # bench-<label>-<index>-<pid>
        got = self.store.setdefault(index, Tokens())
        async for event in self.target.stream(spec, request_id):
            if isinstance(event, TokenChunk):
                got.ids.extend(event.ids)
            elif isinstance(event, TokenFinal):
                got.migrations = event.migrations
            yield event


class TokenRunner(Runner):
    """A `Runner` over a `TokenTarget` whose `tokens` map each request's index in the
    schedule to what it received."""

    def __init__(self, target: TokenTarget, **kwargs: object) -> None:
        self.tokens: dict[int, Tokens] = {}
        super().__init__(_Tap(target, self.tokens), **kwargs)  # type: ignore[arg-type]

    async def _one(self, run: _Run, rec: RequestRecord, spec: RequestSpec) -> None:
        try:
            await super()._one(run, rec, spec)
        finally:
            self.tokens.setdefault(rec.index, Tokens()).end_time = time.time()


async def first_token_s(target: GrpcTarget, spec: RequestSpec, request_id: str) -> float:
    """Seconds from send to the first chunk of one request (raises TargetError); the
    stream is read to its end so the call closes with the server's status."""
    start = time.perf_counter()
    first: float | None = None
    async for event in target.stream(spec, request_id):
        if isinstance(event, ChunkEvent) and first is None:
            first = event.time - start
    if first is None:
        raise TargetError("INCOMPLETE_STREAM", "no chunk")
    return first


