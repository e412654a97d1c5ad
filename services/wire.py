"""Protobuf <-> the boundary types of `services/messages.py`, both directions, for the
public API and the internal worker API alike. The one table of finish reasons lives
here too."""

from __future__ import annotations

import math
from dataclasses import fields

from pdserve.v1 import generate_pb2 as pb
from services.messages import Delta, Sampling, Structured, Timings, TokenLogprob

FINISH_REASONS: dict[str, pb.FinishReason] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
FINISH_NAMES: dict[int, str] = {v: k for k, v in FINISH_REASONS.items()}


def finish_reason_pb(name: str | None) -> pb.FinishReason:
    return FINISH_REASONS.get(name or "", pb.FINISH_REASON_ABORT)


def finish_name(reason: int) -> str:
    return FINISH_NAMES.get(reason, "abort")


# -- sampling -----------------------------------------------------------------------------
def sampling_pb(s: Sampling, max_tokens: int, min_tokens: int) -> pb.SamplingParams:
    """Validated sampling as the worker API carries it, with this phase's budget."""
    out = pb.SamplingParams(min_tokens=min_tokens, max_tokens=max_tokens,
                            stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                            ignore_eos=s.ignore_eos)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed", "logprobs"):
        value = getattr(s, name)
        if value is not None:
            setattr(out, name, value)
    if s.structured is not None:
        out.structured.CopyFrom(structured_pb(s.structured))
    if s.n != 1:
        out.n = s.n
    out.logit_bias.update(dict(s.logit_bias))
    out.include_stop_str_in_output = s.include_stop_str_in_output
    return out


def structured_pb(st: Structured) -> pb.StructuredOutput:
    if st.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if st.kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(choices=list(st.value or ())))
    out = pb.StructuredOutput()
    setattr(out, "json_schema" if st.kind == "json" else st.kind, str(st.value))
    return out


# -- logprobs -----------------------------------------------------------------------------
def logprobs_pb(items: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in items or ()]


def logprobs_of(items: list[pb.TokenLogprob]) -> list[TokenLogprob] | None:
    if not items:
        return None
    return [TokenLogprob(i.token_id, i.logprob, [(t.token_id, t.logprob) for t in i.top])
            for i in items]


# -- timings ------------------------------------------------------------------------------
_TIMING_FIELDS = tuple(f.name for f in fields(Timings))


def timings_pb(t: Timings) -> pb.Timings:
    out = pb.Timings()
    for name in _TIMING_FIELDS:
        value = getattr(t, name)
        if isinstance(value, int) or math.isfinite(value):
            setattr(out, name, value)
    return out


def timings_of(t: pb.Timings) -> Timings:
    return Timings(**{name: getattr(t, name) for name in _TIMING_FIELDS})


# -- stream messages ----------------------------------------------------------------------
def chunk_pb(delta: Delta) -> pb.GenerateResponse:
    """A delta's tokens as a public chunk message."""
    chunk = pb.Chunk(token_ids=delta.token_ids, text=delta.text,
                     logprobs=logprobs_pb(delta.logprobs), index=delta.index)
    if delta.choice_finish_reason is not None:
        chunk.finish_reason = finish_reason_pb(delta.choice_finish_reason)
        stop = delta.choice_stop_reason
        chunk.stop_reason = "" if stop is None else str(stop)
    return pb.GenerateResponse(chunk=chunk)


def is_chunk(delta: Delta) -> bool:
    """Whether a delta goes out as a chunk: it has tokens or text, or ends its choice."""
    return bool(delta.token_ids or delta.text or delta.choice_finish_reason)


def chunk_out(delta: Delta) -> pb.GenerateResponse | bytes:
    """What the public stream sends for a delta: a chunk that arrived from a worker goes
    on as the bytes it came in (`serialize_response` passes them through)."""
    return delta.wire if delta.wire is not None else chunk_pb(delta)


def serialize_response(message: pb.GenerateResponse | bytes) -> bytes:
    """The public stream's serializer: forwarded chunks are already bytes."""
    if type(message) is bytes:
        return message
    return message.SerializeToString()  # type: ignore[union-attr]


def final_pb(delta: Delta, request_id: str = "", prompt_tokens: int = 0,
             completion_tokens: int = 0) -> pb.GenerateResponse:
    stop = delta.stop_reason
    return pb.GenerateResponse(final=pb.Final(
        finish_reason=finish_reason_pb(delta.finish_reason),
        stop_reason="" if stop is None else str(stop),
        usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       cached_tokens=delta.num_cached_tokens),
        timings=timings_pb(delta.timings),
        request_id=request_id,
        migrations=delta.migrations,
    ))


def delta_of_bytes(data: bytes) -> Delta:
    """A streamed message, as the bytes it came in, as a delta. A chunk keeps its bytes
    (`wire`) so whoever forwards it sends them on without serializing anew; the token
    ids are read here because the router must know every token it streamed (to continue
    the request elsewhere if the worker fails)."""
    r = pb.GenerateResponse.FromString(data)
    if r.WhichOneof("response") != "chunk":
        return _final_delta(r.final)
    c = r.chunk
    logprobs = c.logprobs
    delta = Delta(list(c.token_ids), c.text, logprobs_of(list(logprobs)) if logprobs else None,
                  index=c.index, wire=data)
    if c.finish_reason:
        delta.choice_finish_reason = finish_name(c.finish_reason)
        delta.choice_stop_reason = c.stop_reason or None
    return delta


def _final_delta(f: pb.Final) -> Delta:
    return Delta([], "", finished=True, finish_reason=finish_name(f.finish_reason),
                 stop_reason=f.stop_reason or None, num_cached_tokens=f.usage.cached_tokens,
                 timings=timings_of(f.timings))
