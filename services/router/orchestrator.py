"""Prefill, then decode: the disaggregated backend behind the public API.

For each request: pick the decode worker's KV target, ask the prefill worker for the
first token (its KV streams to the decode worker meanwhile), stream token 1 to the
client at once, then stream tokens 2..n from the decode worker. Both workers' layouts
are checked when the pair is connected; an incompatible pair is refused, never used.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services.api.backend import Delta, GenerationRequest, TokenLogprob
from services.api.client import FINISH_NAMES
from services.api.server import grpc_options
from services.api.validation import RequestError
from services.engine.engine import ModelFacts
from services.kv.fingerprint import LayoutFingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)



class PairRefused(RuntimeError):
    """A prefill and a decode worker whose KV layouts differ."""


def check_pair(prefill: wpb.WorkerInfo, decode: wpb.WorkerInfo) -> None:
    if prefill.fingerprint_digest == decode.fingerprint_digest:
        return
    p = LayoutFingerprint.from_dict(json.loads(prefill.fingerprint_json))
    d = LayoutFingerprint.from_dict(json.loads(decode.fingerprint_json))
    raise PairRefused(
        f"prefill worker {prefill.worker_id} and decode worker {decode.worker_id} have "
        f"incompatible KV layouts ({'; '.join(p.differences(d))}); KV is never shipped "
        "between them")


def _logprobs(items: list[pb.TokenLogprob]) -> list[TokenLogprob] | None:
    if not items:
        return None
    return [TokenLogprob(i.token_id, i.logprob, [(t.token_id, t.logprob) for t in i.top])
            for i in items]


def _worker_error(role: str, e: grpc.aio.AioRpcError) -> RequestError:
    code = e.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION):
        return RequestError(code, f"{role} worker: {e.details()}")
    return RequestError(grpc.StatusCode.UNAVAILABLE, f"{role} worker failed: "
                        f"{code.name}: {e.details()}")


@dataclass
class WorkerLink:
    target: str
    channel: grpc.aio.Channel
    info: wpb.WorkerInfo


def kv_target(info: wpb.WorkerInfo) -> wpb.KVTarget:
    return wpb.KVTarget(worker_id=info.worker_id, epoch=info.epoch, kv_address=info.kv_address,
                        kv_transport=info.kv_transport,
                        fingerprint_digest=info.fingerprint_digest)


async def run_pair(req: GenerationRequest, prefill: wpb_grpc.PrefillServiceStub | None,
                   decode: wpb_grpc.DecodeServiceStub, target: wpb.KVTarget,
                   fault: str = "") -> AsyncIterator[Delta]:
    """One request: prefill (token 1, KV shipped to `target`), then decode (tokens 2..n).
    Without a prefill worker the decode worker prefills the prompt itself."""
    timeout = req.timeout_s
    if prefill is None:
        call = decode.Decode(wpb.DecodeRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=_with_max_tokens(req.sampling, req.max_tokens)), timeout=timeout)
        async for delta in _stream_decode(call, {}, 0):
            yield delta
        return
    try:
        first = await prefill.Prefill(wpb.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling, transfer_id=uuid.uuid4().hex, fault=fault, target=target),
            timeout=timeout)
    except grpc.aio.AioRpcError as e:
        raise _worker_error("prefill", e) from e
    prefill_timings = {"queue_s": first.queue_s, "prefill_s": first.prefill_s}
    token1 = Delta([first.first_token_id], first.first_token_text,
                   _logprobs(list(first.logprobs)))
    if first.finished or req.max_tokens == 1:
        token1.finished = True
        token1.finish_reason = "stop" if first.finished else "length"
        token1.stop_reason = first.stop_reason or None
        token1.num_cached_tokens = first.cached_tokens
        token1.timings = prefill_timings
        yield token1
        return
    yield token1
    sampling = _with_max_tokens(req.sampling, req.max_tokens - 1)
    sampling.min_tokens = max(0, sampling.min_tokens - 1)
    call = decode.Decode(wpb.DecodeRequest(
        request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
        first_token_id=first.first_token_id, sampling=sampling, handle=first.handle,
        fault=fault), timeout=None if timeout is None else max(0.1, timeout))
    async for delta in _stream_decode(call, prefill_timings, first.cached_tokens):
        yield delta


def _with_max_tokens(sampling: pb.SamplingParams, max_tokens: int) -> pb.SamplingParams:
    out = pb.SamplingParams()
    out.CopyFrom(sampling)
    out.max_tokens = max_tokens
    return out


async def _stream_decode(call: grpc.aio.UnaryStreamCall, prefill_timings: dict[str, float],
                         cached_tokens: int) -> AsyncIterator[Delta]:
    try:
        async for r in call:
            if r.HasField("chunk"):
                yield Delta(list(r.chunk.token_ids), r.chunk.text,
                            _logprobs(list(r.chunk.logprobs)))
            elif r.HasField("final"):
                yield _final(r.final, prefill_timings, cached_tokens)
                return
    except grpc.aio.AioRpcError as e:
        raise _worker_error("decode", e) from e
    raise RequestError(grpc.StatusCode.UNAVAILABLE, "decode worker: stream ended early")


def _final(final: pb.Final, prefill_timings: dict[str, float], cached_tokens: int) -> Delta:
    t = final.timings
    timings = {"decode_queue_s": t.decode_queue_s, "decode_s": t.decode_s,
               "kv_transfer_s": t.kv_transfer_s, "kv_transfer_bytes": float(t.kv_transfer_bytes),
               "kv_transfer_hidden_s": t.kv_transfer_hidden_s}
    if prefill_timings:
        timings.update(prefill_timings)
    else:  # prefilled on the decode worker: its queue and prefill are the request's
        timings.update(queue_s=t.queue_s, prefill_s=t.prefill_s)
    return Delta([], "", finished=True, finish_reason=FINISH_NAMES.get(final.finish_reason,
                 "abort"), stop_reason=final.stop_reason or None,
                 num_cached_tokens=cached_tokens or final.usage.cached_tokens, timings=timings)


def model_facts(tokenizer: PreTrainedTokenizerBase, model_path: str, model: str,
                max_model_len: int, vocab_size: int, dtype: str) -> ModelFacts:
    eos = tokenizer.eos_token_id
    return ModelFacts(
        name=model, path=Path(model_path), max_model_len=max_model_len, vocab_size=vocab_size,
        eos_token_ids=(eos,) if eos is not None else (), bos_token_id=tokenizer.bos_token_id,
        has_chat_template=bool(tokenizer.chat_template), tokenizer_class=type(tokenizer).__name__,
        dtype=dtype)


class DisaggBackend:
    """One prefill worker and one decode worker (the router generalizes this to pools)."""

    mode = "disaggregated"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model_path: str,
                 local_prefill_max_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._model_path = model_path
        # Prompts up to this long prefill on the decode worker: shipping their KV costs
        # more than computing it there (conditional disaggregation).
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.prefill: WorkerLink | None = None
        self.decode: WorkerLink | None = None
        self._facts: ModelFacts | None = None
        self.fault = ""  # set by tests: fault injection on every request (workers must allow)

    async def connect(self, prefill_target: str, decode_target: str) -> None:
        links: list[WorkerLink] = []
        for target in (prefill_target, decode_target):
            channel = grpc.aio.insecure_channel(target, options=grpc_options(64 << 20))
            stub = (wpb_grpc.PrefillServiceStub if not links else wpb_grpc.DecodeServiceStub)
            info = await stub(channel).GetWorkerInfo(wpb.GetWorkerInfoRequest(), timeout=10)
            links.append(WorkerLink(target, channel, info))
        check_pair(links[0].info, links[1].info)
        self.prefill, self.decode = links
        d = links[1].info
        self._facts = model_facts(self._tokenizer, self._model_path, d.model, d.max_model_len,
                                  d.vocab_size, json.loads(d.fingerprint_json).get("dtype", ""))

    @property
    def facts(self) -> ModelFacts:
        assert self._facts is not None, "connect() first"
        return self._facts

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    async def close(self) -> None:
        for link in (self.prefill, self.decode):
            if link is not None:
                await link.channel.close()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        assert self.prefill is not None and self.decode is not None
        local = len(req.prompt_token_ids) <= self.local_prefill_max_tokens
        async for delta in run_pair(req, None if local else
                                    wpb_grpc.PrefillServiceStub(self.prefill.channel),
                                    wpb_grpc.DecodeServiceStub(self.decode.channel),
                                    kv_target(self.decode.info), self.fault):
            yield delta
