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
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import worker_pb2 as wpb
from services import wire
from services.errors import FailedCall, IncompatiblePair, WorkerFailure, from_worker_status
from services.kv.fingerprint import LayoutFingerprint
from services.messages import Delta, GenerationRequest, Timings, split_budget
from services.router.watchdog import Liveness


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


DECODE_METHOD = "/pdserve.v1.DecodeService/Decode"
RELEASE_METHOD = "/pdserve.v1.DecodeService/Release"
PREFILL_METHOD = "/pdserve.v1.PrefillService/Prefill"
# On DecodeService, which every worker serves (a prefill worker too), so one call fits
# both roles.
WATCH_KV_EVENTS_METHOD = "/pdserve.v1.DecodeService/WatchKVEvents"
RELEASE_TIMEOUT_S = 5.0

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Peer:
    """One worker of the pair, as the caller reaches it: its channel and the calls made
    on it, built once per channel rather than once per request. The decode stream
    arrives as bytes: chunks are forwarded to the client as they came. `watch_kv_events`
    is the router's subscription to the worker's KV cache events, on the same channel
    and credentials."""

    worker_id: str
    channel: grpc.aio.Channel
    prefill: grpc.aio.UnaryUnaryMultiCallable = field(init=False, repr=False)
    decode: grpc.aio.UnaryStreamMultiCallable = field(init=False, repr=False)
    release: grpc.aio.UnaryUnaryMultiCallable = field(init=False, repr=False)
    watch_kv_events: grpc.aio.UnaryStreamMultiCallable = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", self.channel.unary_unary(
            PREFILL_METHOD, request_serializer=wpb.PrefillRequest.SerializeToString,
            response_deserializer=wpb.PrefillResponse.FromString))
        object.__setattr__(self, "decode", self.channel.unary_stream(
            DECODE_METHOD, request_serializer=wpb.DecodeRequest.SerializeToString,
            response_deserializer=None))  # None: the message's bytes
        object.__setattr__(self, "release", self.channel.unary_unary(
            RELEASE_METHOD, request_serializer=wpb.ReleaseRequest.SerializeToString,
            response_deserializer=wpb.ReleaseResponse.FromString))
        object.__setattr__(self, "watch_kv_events", self.channel.unary_stream(
            WATCH_KV_EVENTS_METHOD,
            request_serializer=wpb.WatchKVEventsRequest.SerializeToString,
            response_deserializer=wpb.WatchKVEventsResponse.FromString))


_RELEASING: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references


def release_later(decode: Peer, transfer_id: str) -> None:
    """Tell the decode worker, in the background, that no Decode call will take this
    transfer, so its staging is freed now rather than when the lease ends (and a
    transfer still on its way stops, which frees the prefill worker's blocks)."""

    async def release() -> None:
        try:
            await decode.release(wpb.ReleaseRequest(transfer_id=transfer_id),
                                 timeout=RELEASE_TIMEOUT_S)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:  # a dead worker's
            # staging is gone anyway; a closed channel: the router is shutting down
            log.debug("release of %s on %s: %s", transfer_id, decode.worker_id, e)

    task = asyncio.get_running_loop().create_task(release())
    _RELEASING.add(task)
    task.add_done_callback(_RELEASING.discard)


def _failure(role: str, peer: Peer, e: grpc.aio.AioRpcError, streamed: int) -> Exception:
    return from_worker_status(FailedCall(role, peer.worker_id, e.code(), e.details() or ""),
                              streamed)


async def run_pair(req: GenerationRequest, prefill: Peer | None, decode: Peer,
                   target: wpb.KVTarget, fault: str = "",
                   liveness: Liveness | None = None,
                   metadata: tuple[tuple[str, str], ...] | None = None,
                   *, reuse_tokens: int = 0) -> AsyncIterator[Delta]:
    """One request: prefill (token 1, KV shipped to `target`), then decode (tokens 2..n).
    Without a prefill worker the decode worker prefills the prompt itself. The last
    delta is finished and carries both phases' timings. `metadata` goes with both calls
    (the trace context, so the workers' spans join the caller's trace).

    `reuse_tokens`: the prompt's first tokens the decode worker is believed to hold in its
    prefix cache, a whole number of KV blocks; their blocks are not shipped. A wrong
    belief costs time, never correctness: the decode worker then computes the prompt."""
    liveness = liveness or Liveness()
    timeout = req.timeout_s
    s = req.sampling
    if prefill is None:
        call = decode.decode(wpb.DecodeRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=wire.sampling_pb(s, req.max_tokens, s.min_tokens), fault=fault,
            generated_tokens=req.generated_tokens, lora_name=req.lora), timeout=timeout,
            metadata=metadata)
        async for delta in _stream_decode(call, decode, None, 0, 0, liveness):
            yield delta
        return
    async for delta in _run_split(req, prefill, decode, target, fault, liveness, metadata,
                                  reuse_tokens):
        yield delta


async def _run_split(req: GenerationRequest, prefill: Peer, decode: Peer,
                     target: wpb.KVTarget, fault: str, liveness: Liveness,
                     metadata: tuple[tuple[str, str], ...] | None,
                     reuse_tokens: int) -> AsyncIterator[Delta]:
    timeout = req.timeout_s
    s = req.sampling
    transfer_id = uuid.uuid4().hex
    loaded = False  # the decode worker took the transfer and the answer ended there
    try:
        first_budget, rest = split_budget(req.max_tokens, s.min_tokens)
        many = s.n > 1  # n answers: the prefill worker ships the prompt's KV once
        prefill_sampling = wire.sampling_pb(s, first_budget.max_tokens, first_budget.min_tokens)
        prefill_sampling.ClearField("n")
        call1 = prefill.prefill(wpb.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=prefill_sampling,
            transfer_id=transfer_id, fault=fault, target=target,
            generated_tokens=req.generated_tokens, lora_name=req.lora,
            reuse_tokens=reuse_tokens), timeout=timeout, metadata=metadata)
        watch = liveness.watch(call1, "prefill", prefill.worker_id, prefill.channel)
        try:
            first = await call1
        except grpc.aio.AioRpcError as e:
            raise _failure("prefill", prefill, e, 0) from e
        except asyncio.CancelledError:
            if watch.hung:
                raise watch.failure(0) from None
            raise
        finally:
            liveness.unwatch(watch)
        prefill_timings = Timings(queue_s=first.queue_s, prefill_s=first.prefill_s)
        if many:
            # Every choice samples all its tokens on the decode worker (choice i with seed
            # + i, as vLLM's parallel sampling): the prefill worker's token 1 is not one
            # of them, so seeded answers are vLLM's. The decode worker has the whole budget.
            call = decode.decode(wpb.DecodeRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                sampling=wire.sampling_pb(s, req.max_tokens, s.min_tokens),
                handle=first.handle, fault=fault, generated_tokens=req.generated_tokens,
                lora_name=req.lora),
                timeout=None if timeout is None else max(0.1, timeout), metadata=metadata)
            async for delta in _stream_decode(call, decode, prefill_timings,
                                              first.cached_tokens, 0, liveness):
                loaded = delta.finished
                yield delta
            return
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
        call = decode.decode(wpb.DecodeRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            first_token_id=first.first_token_id,
            sampling=wire.sampling_pb(s, rest.max_tokens, rest.min_tokens), handle=first.handle,
            fault=fault, generated_tokens=req.generated_tokens, lora_name=req.lora),
            timeout=None if timeout is None else max(0.1, timeout),
            metadata=metadata)
        async for delta in _stream_decode(call, decode, prefill_timings, first.cached_tokens, 1,
                                          liveness):
            loaded = delta.finished
            yield delta
    finally:
        # Cancelled, failed, moved, or answered by token 1: the KV shipped for this
        # request will never be loaded.
        if not loaded:
            release_later(decode, transfer_id)


async def _stream_decode(call: grpc.aio.UnaryStreamCall, decode: Peer,
                         prefill_timings: Timings | None, cached_tokens: int,
                         streamed: int, liveness: Liveness) -> AsyncIterator[Delta]:
    """The decode worker's stream as deltas; chunks keep their bytes for forwarding.
    `streamed` counts the request's tokens the caller has already passed on."""
    watch = liveness.watch(call, "decode", decode.worker_id, decode.channel)
    clock = time.monotonic
    try:
        async for data in call:
            watch.last = clock()
            delta = wire.delta_of_bytes(data)
            if delta.finished:
                if prefill_timings is not None:  # the queue and prefill were the other's
                    delta.timings.queue_s = prefill_timings.queue_s
                    delta.timings.prefill_s = prefill_timings.prefill_s
                    # Prefix-cache hits are the prefill engine's: the decode engine
                    # counts the KV it received as cached, which it was not.
                    delta.num_cached_tokens = cached_tokens
                yield delta
                return
            streamed += len(delta.token_ids)
            yield delta
    except grpc.aio.AioRpcError as e:
        if watch.hung:
            raise watch.failure(streamed) from e
        raise _failure("decode", decode, e, streamed) from e
    except asyncio.CancelledError:
        if watch.hung:
            raise watch.failure(streamed) from None
        raise
    finally:
        liveness.unwatch(watch)
        call.cancel()  # no-op when done; else aborts the request on the worker
    raise WorkerFailure(FailedCall("decode", decode.worker_id, grpc.StatusCode.UNAVAILABLE,
                                   "the stream ended without a final message"), streamed)
