"""vLLM's terms <-> pdserve's: sampling settings into vLLM's `SamplingParams`, vLLM's
`RequestOutput` into a `Delta`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.messages import Delta, Sampling, Timings, TokenLogprob

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams


def vllm_params(sampling: Sampling, max_tokens: int, min_tokens: int | None = None,
                extra_args: dict[str, Any] | None = None) -> SamplingParams:
    """vLLM SamplingParams streaming deltas; `min_tokens` overrides the client's (a
    phase of a disaggregated request owes only part of it)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs = sampling.vllm_kwargs()
    if min_tokens is not None:
        kwargs["min_tokens"] = min_tokens
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
