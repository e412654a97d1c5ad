"""The public gRPC generation service: a thin shell that converts protobuf to the
backend's terms and back. Validation lives in `validation`, prompt rendering in
`prompts`, the serving itself in a `Backend`."""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc
from services.api import validation
from services.api.backend import Backend, Delta
from services.api.prepare import limits_of, prepare

log = logging.getLogger(__name__)

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def finish_reason_pb(delta: Delta) -> pb.FinishReason:
    return FINISH_REASONS.get(delta.finish_reason or "", pb.FINISH_REASON_ABORT)


def logprob_messages(delta: Delta) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in delta.logprobs or ()]


def chunk_message(delta: Delta) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(token_ids=delta.token_ids, text=delta.text,
                                              logprobs=logprob_messages(delta)))


def _final(
    delta: Delta, request_id: str, prompt_tokens: int, completion_tokens: int,
    ttft_s: float, e2e_s: float,
) -> pb.GenerateResponse:
    timings = pb.Timings(ttft_s=ttft_s, e2e_s=e2e_s)
    for name, value in delta.timings.items():
        if math.isfinite(value):
            setattr(timings, name, type(getattr(timings, name))(value))  # int for byte counts
    stop = delta.stop_reason
    return pb.GenerateResponse(
        final=pb.Final(
            finish_reason=finish_reason_pb(delta),
            stop_reason="" if stop is None else str(stop),
            usage=pb.Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cached_tokens=delta.num_cached_tokens,
            ),
            timings=timings,
            request_id=request_id,
        )
    )


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.limits = limits_of(backend.facts)


    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        started = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            metadata = dict(context.invocation_metadata() or ())
            req = prepare(request, request_id, self.limits, self.backend.tokenizer,
                          context.time_remaining(), str(metadata.get("x-client-id", "")))
        except validation.RequestError as e:
            await context.abort(e.code, e.message)
        prompt_tokens = len(req.prompt_token_ids)
        completion_tokens = 0
        ttft_s = 0.0
        try:
            async for delta in self.backend.generate(req):
                if delta.token_ids or delta.text:
                    if completion_tokens == 0 and delta.token_ids:
                        ttft_s = time.monotonic() - started
                    completion_tokens += len(delta.token_ids)
                    yield chunk_message(delta)
                if delta.finished:
                    yield _final(
                        delta, request_id, prompt_tokens, completion_tokens,
                        ttft_s, time.monotonic() - started,
                    )
                    return
        except validation.RequestError as e:
            if e.retry_after_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", str(e.retry_after_ms)),))
            await context.abort(e.code, e.message)
        except Exception as e:
            name = type(e).__name__
            if name in ("ValueError", "VLLMValidationError"):  # vLLM refused a parameter
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if name == "EngineDeadError":
                log.error("engine died serving %s: %s", request_id, e)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not running")
            log.exception("request %s failed", request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {name}: {e}")
        # The engine stream ended without a finished output: it was aborted.
        await context.abort(grpc.StatusCode.ABORTED, "the request was aborted by the server")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        f = self.backend.facts
        info = pb.GetModelInfoResponse(
            model=f.name,
            max_model_len=f.max_model_len,
            vocab_size=f.vocab_size,
            eos_token_ids=list(f.eos_token_ids),
            has_chat_template=f.has_chat_template,
            tokenizer=f.tokenizer_class,
            dtype=f.dtype,
            serving_mode=self.backend.mode,
        )
        if f.bos_token_id is not None:
            info.bos_token_id = f.bos_token_id
        return info
