"""What the public API serves from: a backend that turns token ids into a stream of
deltas. The colocated backend is one vLLM engine; the disaggregated one chains a
prefill worker and a decode worker. The servicer never knows which."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.v1 import generate_pb2 as pb
from services.engine.engine import Engine, EngineTimings, ModelFacts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import RequestOutput, SamplingParams


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class Delta:
    """New tokens of one request since the previous delta."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    # Server-side anatomy in seconds (names as in the API's Timings message), set on
    # the last delta.
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request, in the terms every backend understands."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: pb.SamplingParams  # as the client sent it (forwarded to workers)
    sampling_kwargs: dict[str, Any]  # validated keyword arguments for vLLM's SamplingParams
    max_tokens: int  # resolved against the context length
    timeout_s: float | None = None  # what is left of the client's deadline, if it set one
    client_id: str = ""  # the caller's x-client-id, for per-client limits


def vllm_params(req: GenerationRequest, max_tokens: int | None = None,
                **overrides: Any) -> SamplingParams:
    """vLLM SamplingParams streaming deltas, with `overrides` on top."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs = {**req.sampling_kwargs, **overrides}
    return SamplingParams(max_tokens=max_tokens or req.max_tokens,
                          output_kind=RequestOutputKind.DELTA, **kwargs)


class Backend(Protocol):
    @property
    def facts(self) -> ModelFacts: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def mode(self) -> str: ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]: ...


def _logprobs(out: Any, token_ids: list[int]) -> list[TokenLogprob] | None:
    if out.logprobs is None:
        return None
    result = []
    for token_id, entry in zip(token_ids, out.logprobs, strict=False):
        chosen = entry.get(token_id)
        top = sorted(
            ((t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank > 0),
            key=lambda x: -x[1],
        )
        result.append(TokenLogprob(token_id, chosen.logprob if chosen else float("nan"), top))
    return result


def delta_from_output(output: RequestOutput) -> Delta:
    out = output.outputs[0]
    token_ids = list(out.token_ids)
    delta = Delta(token_ids=token_ids, text=out.text, logprobs=_logprobs(out, token_ids))
    if output.finished:
        t = EngineTimings.from_output(output)
        delta.finished = True
        delta.finish_reason = out.finish_reason or "abort"
        delta.stop_reason = out.stop_reason
        delta.num_cached_tokens = int(output.num_cached_tokens or 0)
        delta.timings = {"queue_s": t.queue_s, "prefill_s": t.prefill_s, "decode_s": t.decode_s}
    return delta


class ColocatedBackend:
    """One engine does prefill and decode: plain vLLM behind the public API."""

    mode = "colocated"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def facts(self) -> ModelFacts:
        return self.engine.facts

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        params = vllm_params(req)
        async for output in self.engine.generate(req.prompt_token_ids, params, req.request_id):
            yield delta_from_output(output)
