"""The boundary types of pdserve: what a front end hands a backend and what streams
back. Plain dataclasses: no protobuf, no vLLM. `services/wire.py` converts them to and
from protobuf; `services/engine/outputs.py` builds them from vLLM's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

# Fields whose empty value means "not asked for" (vLLM gets them only when set).
_UNSET: dict[str, Any] = {"stop": (), "stop_token_ids": (), "ignore_eos": False, "min_tokens": 0,
                          "n": 1, "logit_bias": (), "include_stop_str_in_output": False}


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class Structured:
    """An output constraint (vLLM's structured outputs): `kind` is one of
    STRUCTURED_KINDS, `value` the JSON schema's text, the regex, the grammar, the
    choices, or None for json_object."""

    kind: str
    value: str | tuple[str, ...] | None = None

    def vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for vLLM's StructuredOutputsParams."""
        if self.kind == "json_object":
            return {"json_object": True}
        value = list(self.value) if isinstance(self.value, tuple) else self.value
        return {self.kind: value}


@dataclass(frozen=True, slots=True)
class Sampling:
    """Validated sampling settings (`limits.check_sampling` builds them). `None`
    means "vLLM's default"."""

    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None  # 0 = off
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # as asked; GenerationRequest.max_tokens is resolved
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top log-probabilities per token
    structured: Structured | None = None  # an output constraint
    n: int = 1  # answers (choices) to the one prompt; choice i samples with seed + i
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ordered by token id
    include_stop_str_in_output: bool = False

    def vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for vLLM's SamplingParams, without max_tokens and the
        output constraint (`services/engine/outputs.py` builds vLLM's own type for it)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if (f.name in ("max_tokens", "structured") or value is None
                    or _UNSET.get(f.name, ...) == value):
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        if self.logit_bias:
            out["logit_bias"] = dict(self.logit_bias)
        return out


@dataclass(frozen=True, slots=True)
class PhaseBudget:
    """How many tokens one phase may and must produce."""

    max_tokens: int
    min_tokens: int


def split_budget(max_tokens: int, min_tokens: int) -> tuple[PhaseBudget, PhaseBudget]:
    """The output budget of a disaggregated request, split between its phases: the
    prefill worker produces token 1 (a `min_tokens` keeps EOS from ending the answer
    there), the decode worker the other `max_tokens - 1`, owing what is left of
    `min_tokens`. The decode budget is empty when the answer is one token long."""
    prefill = PhaseBudget(max_tokens=1, min_tokens=min(1, min_tokens))
    decode = PhaseBudget(max_tokens=max_tokens - 1, min_tokens=max(0, min_tokens - 1))
    return prefill, decode


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request, in the terms every backend understands."""

    request_id: str  # pdserve's own id, unique per request: what is aborted and logged
    prompt_token_ids: list[int]
    sampling: Sampling
    max_tokens: int  # resolved against the context length
    timeout_s: float | None = None  # what is left of the client's deadline, if it set one
    client_id: str = ""  # who sent it (API key name or x-client-id), for per-client limits
    client_request_id: str = ""  # the client's own `request_id`, echoed, never acted on
    # The client's W3C trace context (traceparent, tracestate) when tracing is on.
    trace_headers: tuple[tuple[str, str], ...] = ()
    # The last `generated_tokens` of prompt_token_ids are the answer so far (a request
    # resumed elsewhere): an output constraint resumes after them instead of restarting.
    generated_tokens: int = 0
    # The LoRA adapter the request names as its model ("" = the base model): prefill and
    # decode both run under it, as the KV they hand over was computed with it.
    lora: str = ""
    # The base model the request runs on ("" = the backend's default): a router serving
    # several models picks its pair among that model's workers only.
    model: str = ""

    def continued(self, generated: list[int]) -> GenerationRequest:
        """The same request resumed after `generated` tokens (a migration): those tokens
        join the prompt and leave the budget."""
        s = self.sampling
        sampling = replace(s, min_tokens=max(0, s.min_tokens - len(generated)))
        return replace(self, prompt_token_ids=[*self.prompt_token_ids, *generated],
                       sampling=sampling, max_tokens=self.max_tokens - len(generated),
                       generated_tokens=self.generated_tokens + len(generated))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True)
class Timings:
    """Server-side anatomy of one request, in seconds (names as in the API's Timings
    message). Each hop fills what it measured; the front end adds ttft_s and e2e_s."""

    queue_s: float = 0.0  # waiting in the (prefill) engine before first scheduled
    prefill_s: float = 0.0  # first scheduled -> first token computed
    ttft_s: float = 0.0  # request received -> first token sent
    decode_s: float = 0.0  # first token -> last token
    e2e_s: float = 0.0  # request received -> final message
    router_queue_s: float = 0.0  # request received -> handed to a worker
    kv_transfer_s: float = 0.0  # first KV byte sent -> last KV byte received
    kv_transfer_bytes: int = 0
    kv_transfer_hidden_s: float = 0.0  # part of kv_transfer_s overlapped with prefill
    decode_queue_s: float = 0.0  # decode request received -> first decode step
    kv_prompt_bytes: int = 0  # the prompt's whole KV: what shipping every block would move
    kv_reused_tokens: int = 0  # prompt tokens the decode worker had in its own prefix cache


@dataclass(slots=True)
class Delta:
    """New tokens of one request since the previous delta; the last one is finished
    and carries the finish reason, usage and timings."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    index: int = 0  # the choice the tokens belong to (n > 1)
    # n > 1: how this delta's choice ended, on its last delta (the request's last delta
    # tells the request's end: choice 0's)
    choice_finish_reason: str | None = None
    choice_stop_reason: str | int | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    timings: Timings = field(default_factory=Timings)
    migrations: int = 0  # on the last delta: times the request moved to another worker
    # The serialized public message this delta arrived as (a worker's chunk on the
    # router path): sent on as these bytes, never rebuilt.
    wire: bytes | None = None
