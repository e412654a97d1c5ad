"""Running one request on a (prefill, decode) pair, and checking that a pair may be
used at all.

`run_pair`: ask the prefill worker for the first token (its KV streams to the decode
worker meanwhile), stream token 1 at once, then stream tokens 2..n from the decode
worker. Without a prefill worker the decode worker serves the whole request. A worker's
failure becomes the `services.errors` type that says whose it was and how far the
answer got; which worker to route around and whether to migrate is the router's call.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services import wire
from services.errors import FailedCall, IncompatiblePair, WorkerFailure, from_worker_status
from services.kv.fingerprint import LayoutFingerprint
from services.messages import Delta, GenerationRequest, Timings, split_budget


def check_pair(prefill: wpb.WorkerInfo, decode: wpb.WorkerInfo) -> None:
    """Refuse a pair whose KV layouts differ: KV is never shipped between them."""
    if prefill.fingerprint_digest == decode.fingerprint_digest:
        return
    p = LayoutFingerprint.from_dict(json.loads(prefill.fingerprint_json))
    d = LayoutFingerprint.from_dict(json.loads(decode.fingerprint_json))
    raise IncompatiblePair(
        f"prefill worker {prefill.worker_id} and decode worker {decode.worker_id} have "
        f"incompatible KV layouts ({'; '.join(p.differences(d))}); KV is never shipped "
        "between them")


@dataclass(frozen=True, slots=True)
class Peer:
    """One worker of the pair, as the caller reaches it."""

    worker_id: str
    channel: grpc.aio.Channel


@dataclass(frozen=True, slots=True)
class Liveness:
    """How a hung worker (alive to TCP, silent to us: a stopped process, a wedged loop)
    is told from a slow one: after `silence_s` without an answer it is asked for its
    health, and one that does not answer within `probe_timeout_s` has failed."""

    silence_s: float = 1.0
    probe_timeout_s: float = 1.0


async def answers(peer: Peer, timeout_s: float) -> bool:
    """Whether the worker's gRPC server answers a health check in time (any status: a
    draining worker still serves the streams it has)."""
    try:
        await health_pb2_grpc.HealthStub(peer.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return True


class Watchdog:
    """Watches one call to a worker: `seen()` on every message; after `silence_s`
    without one, the worker is probed, and a worker that does not answer has its call
    cancelled and `hung` set. Costs one timestamp per message on the stream's path."""

    def __init__(self, call: grpc.aio.Call, role: str, peer: Peer, liveness: Liveness) -> None:
        self.call, self.role, self.peer, self.liveness = call, role, peer, liveness
        self.last = time.monotonic()
        self.hung = ""
        self._task = asyncio.create_task(self._watch())

    def seen(self) -> None:
        self.last = time.monotonic()

    async def _watch(self) -> None:
        silence = self.liveness.silence_s
        while True:
            await asyncio.sleep(max(0.01, self.last + silence - time.monotonic()))
            quiet = time.monotonic() - self.last
            if quiet < silence:
                continue
            if await answers(self.peer, self.liveness.probe_timeout_s):
                self.last = time.monotonic()  # slow, not hung: give it another period
                continue
            self.hung = f"silent for {quiet:.1f} s and no answer to a liveness probe"
            self.call.cancel()
            return

    def failure(self, streamed: int) -> WorkerFailure:
        return WorkerFailure(FailedCall(self.role, self.peer.worker_id,
                                        grpc.StatusCode.UNAVAILABLE, self.hung), streamed)

    def stop(self) -> None:
        self._task.cancel()


def _failure(role: str, peer: Peer, e: grpc.aio.AioRpcError, streamed: int) -> Exception:
    return from_worker_status(FailedCall(role, peer.worker_id, e.code(), e.details() or ""),
                              streamed)


async def run_pair(req: GenerationRequest, prefill: Peer | None, decode: Peer,
                   target: wpb.KVTarget, fault: str = "",
                   liveness: Liveness = Liveness(),
                   metadata: tuple[tuple[str, str], ...] | None = None
                   ) -> AsyncIterator[Delta]:
    """One request: prefill (token 1, KV shipped to `target`), then decode (tokens 2..n).
    Without a prefill worker the decode worker prefills the prompt itself. The last
    delta is finished and carries both phases' timings. `metadata` goes with both calls
    (the trace context, so the workers' spans join the caller's trace)."""
    timeout = req.timeout_s
    s = req.sampling
    if prefill is None:
        call = wpb_grpc.DecodeServiceStub(decode.channel).Decode(wpb.DecodeRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=wire.sampling_pb(s, req.max_tokens, s.min_tokens), fault=fault),
            timeout=timeout, metadata=metadata)
        async for delta in _stream_decode(call, decode, None, 0, 0, liveness):
            yield delta
        return
    first_budget, rest = split_budget(req.max_tokens, s.min_tokens)
    call1 = wpb_grpc.PrefillServiceStub(prefill.channel).Prefill(wpb.PrefillRequest(
        request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
        sampling=wire.sampling_pb(s, first_budget.max_tokens, first_budget.min_tokens),
        transfer_id=uuid.uuid4().hex, fault=fault, target=target), timeout=timeout,
        metadata=metadata)
    dog = Watchdog(call1, "prefill", prefill, liveness)
    try:
        first = await call1
    except grpc.aio.AioRpcError as e:
        raise _failure("prefill", prefill, e, 0) from e
    except asyncio.CancelledError:
        if dog.hung:
            raise dog.failure(0) from None
        raise
    finally:
        dog.stop()
    prefill_timings = Timings(queue_s=first.queue_s, prefill_s=first.prefill_s)
    token1 = Delta([first.first_token_id], first.first_token_text,
                   wire.logprobs_of(list(first.logprobs)))
    if first.finished or rest.max_tokens == 0:
        token1.finished = True
        token1.finish_reason = "stop" if first.finished else "length"
        token1.stop_reason = first.stop_reason or None
        token1.num_cached_tokens = first.cached_tokens
        token1.timings = prefill_timings
        yield token1
        return
    yield token1
    call = wpb_grpc.DecodeServiceStub(decode.channel).Decode(wpb.DecodeRequest(
        request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
        first_token_id=first.first_token_id,
        sampling=wire.sampling_pb(s, rest.max_tokens, rest.min_tokens), handle=first.handle,
        fault=fault), timeout=None if timeout is None else max(0.1, timeout),
        metadata=metadata)
    async for delta in _stream_decode(call, decode, prefill_timings, first.cached_tokens, 1,
                                      liveness):
        yield delta


async def _stream_decode(call: grpc.aio.UnaryStreamCall, decode: Peer,
                         prefill_timings: Timings | None, cached_tokens: int,
                         streamed: int, liveness: Liveness) -> AsyncIterator[Delta]:
    """The decode worker's stream as deltas; chunks keep their message for forwarding.
    `streamed` counts the request's tokens the caller has already passed on."""
    dog = Watchdog(call, "decode", decode, liveness)
    try:
        async for r in call:
            dog.seen()
            delta = wire.delta_of(r)
            if delta.finished:
                if prefill_timings is not None:  # the queue and prefill were the other's
                    delta.timings.queue_s = prefill_timings.queue_s
                    delta.timings.prefill_s = prefill_timings.prefill_s
                    delta.num_cached_tokens = cached_tokens or delta.num_cached_tokens
                yield delta
                return
            streamed += len(delta.token_ids)
            yield delta
    except grpc.aio.AioRpcError as e:
        if dog.hung:
            raise dog.failure(streamed) from e
        raise _failure("decode", decode, e, streamed) from e
    except asyncio.CancelledError:
        if dog.hung:
            raise dog.failure(streamed) from None
        raise
    finally:
        dog.stop()
        call.cancel()  # no-op when done; else aborts the request on the worker
    raise WorkerFailure(FailedCall("decode", decode.worker_id, grpc.StatusCode.UNAVAILABLE,
                                   "the stream ended without a final message"), streamed)
