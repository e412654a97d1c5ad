"""vLLM's terms <-> pdserve's: sampling settings into vLLM's `SamplingParams`, vLLM's
`RequestOutput` into a `Delta`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.messages import Delta, Sampling, Timings, TokenLogprob

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams


def vllm_params(sampling: Sampling, max_tokens: int, min_tokens: int | None = None,
                extra_args: dict[str, Any] | None = None,
                resume_tokens: int = 0) -> SamplingParams:
    """vLLM SamplingParams streaming deltas; `min_tokens` overrides the client's (a
    phase of a disaggregated request owes only part of it). `resume_tokens`: the last
    that many prompt tokens are the answer so far, which an output constraint resumes
    after (`services/engine/structured.py`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    from services.engine.structured import RESUME_KEY

    kwargs = sampling.vllm_kwargs()
    if min_tokens is not None:
        kwargs["min_tokens"] = min_tokens
    if sampling.structured is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(
            **sampling.structured.vllm_kwargs())
        if resume_tokens:
            extra_args = {**(extra_args or {}), RESUME_KEY: resume_tokens}
    if extra_args:
        kwargs["extra_args"] = extra_args
    return SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **kwargs)


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


def engine_timings(output: RequestOutput) -> Timings:
    """Queue, prefill and decode times from vLLM's own monotonic per-request stamps."""
    m: Any = output.metrics
    if m is None or not getattr(m, "queued_ts", 0.0):
        return Timings()
    return Timings(queue_s=max(0.0, m.scheduled_ts - m.queued_ts),
                   prefill_s=max(0.0, m.first_token_ts - m.scheduled_ts),
                   decode_s=max(0.0, m.last_token_ts - m.first_token_ts))


def delta_of_output(output: RequestOutput) -> Delta:
    out = output.outputs[0]
    token_ids = list(out.token_ids)
    delta = Delta(token_ids=token_ids, text=out.text, logprobs=_logprobs(out, token_ids))
    if output.finished:
        delta.finished = True
        delta.finish_reason = out.finish_reason or "abort"
        delta.stop_reason = out.stop_reason
        delta.num_cached_tokens = int(output.num_cached_tokens or 0)
        delta.timings = engine_timings(output)
    return delta


def choice_deltas(output: RequestOutput) -> list[Delta]:
    """n > 1: the new tokens of each choice in `output` (vLLM's parallel sampling sends one
    choice's per output), each ending choice with its finish reason. Never finished:
    `end_delta` tells the request's end."""
    deltas = []
    for out in output.outputs:
        token_ids = list(out.token_ids)
        delta = Delta(token_ids=token_ids, text=out.text, logprobs=_logprobs(out, token_ids),
                      index=out.index)
        if out.finish_reason is not None:
            delta.choice_finish_reason = out.finish_reason
            delta.choice_stop_reason = out.stop_reason
        deltas.append(delta)
    return deltas


def end_delta(output: RequestOutput, finish_reason: str | None,
              stop_reason: str | int | None) -> Delta:
    """The finished delta of an n > 1 request: no tokens (each choice's came in its own
    deltas), the finish reason of choice 0, the request's cached tokens and timings."""
    return Delta([], "", finished=True, finish_reason=finish_reason or "abort",
                 stop_reason=stop_reason, num_cached_tokens=int(output.num_cached_tokens or 0),
                 timings=engine_timings(output))


class Choices:
    """The deltas of an n > 1 request from vLLM's outputs: each choice's, then the end."""

    def __init__(self) -> None:
        self.finish: tuple[str | None, str | int | None] = (None, None)

    def deltas(self, output: RequestOutput) -> list[Delta]:
        deltas = choice_deltas(output)
        for d in deltas:
            if d.index == 0 and d.choice_finish_reason is not None:
                self.finish = (d.choice_finish_reason, d.choice_stop_reason)
        if output.finished:
            deltas.append(end_delta(output, *self.finish))
        return deltas
