"""What the public API serves from: a backend that turns a `GenerationRequest` into a
stream of `Delta`s. The colocated backend is one vLLM engine; the router's backend runs
prefill and decode workers (`services/router/router.py`). The fronts never know which."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from services.engine.engine import Engine, ModelFacts
from services.engine.outputs import Choices, delta_of_output, vllm_params
from services.messages import Delta, GenerationRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Backend(Protocol):
    @property
    def facts(self) -> ModelFacts: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def mode(self) -> str: ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """The request's deltas, the last one finished. Failures raise a
        `services.errors.PdserveError`; closing the stream aborts the request."""
        ...


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
        params = vllm_params(req.sampling, req.max_tokens)
        stream = self.engine.generate(req.prompt_token_ids, params, req.request_id)
        if req.sampling.n == 1:
            async for output in stream:
                yield delta_of_output(output)
            return
        choices = Choices()  # vLLM's parallel sampling: choice i samples with seed + i
        async for output in stream:
            for delta in choices.deltas(output):
                yield delta
