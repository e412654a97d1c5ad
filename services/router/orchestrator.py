"""Running one request on a (prefill, decode) pair, and checking that a pair may be
used at all.

`run_pair`: ask the prefill worker for the first token (its KV streams to the decode
worker meanwhile), stream token 1 at once, then stream tokens 2..n from the decode
worker. Without a prefill worker the decode worker serves the whole request. A worker's
failure becomes the `services.errors` type that says whose it was and how far the
answer got; which worker to route around and whether to migrate is the router's call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

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


def _failure(role: str, peer: Peer, e: grpc.aio.AioRpcError, streamed: int) -> Exception:
    return from_worker_status(FailedCall(role, peer.worker_id, e.code(), e.details() or ""),
                              streamed)


async def run_pair(req: GenerationRequest, prefill: Peer | None, decode: Peer,
                   target: wpb.KVTarget, fault: str = "") -> AsyncIterator[Delta]:
    """One request: prefill (token 1, KV shipped to `target`), then decode (tokens 2..n).
    Without a prefill worker the decode worker prefills the prompt itself. The last
    delta is finished and carries both phases' timings."""
    timeout = req.timeout_s
    s = req.sampling
    if prefill is None:
        call = wpb_grpc.DecodeServiceStub(decode.channel).Decode(wpb.DecodeRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=wire.sampling_pb(s, req.max_tokens, s.min_tokens), fault=fault),
            timeout=timeout)
        async for delta in _stream_decode(call, decode, None, 0, 0):
            yield delta
        return
    first_budget, rest = split_budget(req.max_tokens, s.min_tokens)
    try:
        first = await wpb_grpc.PrefillServiceStub(prefill.channel).Prefill(wpb.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=wire.sampling_pb(s, first_budget.max_tokens, first_budget.min_tokens),
            transfer_id=uuid.uuid4().hex, fault=fault, target=target), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        raise _failure("prefill", prefill, e, 0) from e
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
        fault=fault), timeout=None if timeout is None else max(0.1, timeout))
    async for delta in _stream_decode(call, decode, prefill_timings, first.cached_tokens, 1):
        yield delta


async def _stream_decode(call: grpc.aio.UnaryStreamCall, decode: Peer,
                         prefill_timings: Timings | None, cached_tokens: int,
                         streamed: int) -> AsyncIterator[Delta]:
    """The decode worker's stream as deltas; chunks keep their message for forwarding."""
    try:
        async for r in call:
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
        raise _failure("decode", decode, e, streamed) from e
    finally:
        call.cancel()  # no-op when done; else aborts the request on the worker
    raise WorkerFailure(FailedCall("decode", decode.worker_id, grpc.StatusCode.UNAVAILABLE,
                                   "the stream ended without a final message"), streamed)
