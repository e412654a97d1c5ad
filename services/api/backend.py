"""What the public API serves from: a backend that turns a `GenerationRequest` into a
stream of `Delta`s. The colocated backend is one vLLM engine; the router's backend runs
prefill and decode workers (`services/router/router.py`). The fronts never know which."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from services.api.models import ServedModel
from services.engine.engine import Engine, ModelFacts
from services.engine.outputs import Choices, delta_of_output, vllm_params
from services.errors import InvalidRequest
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

    def served_models(self) -> list[ServedModel]:
        """Every base model served, with its adapters; the default (the one `facts`
        and `tokenizer` describe, and requests without `model` run on) first."""
        ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """The request's deltas, the last one finished. Failures raise a
        `services.errors.PdserveError`; closing the stream aborts the request."""
        ...

    def adapter_paths(self) -> dict[str, str]:
        """The LoRA adapters a request may name as its model: name -> folder."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter: `InvalidRequest` names what is wrong with the folder, or
        that the name is taken."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Unload a LoRA adapter (`ModelNotFound`: none by that name)."""
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

    def adapter_paths(self) -> dict[str, str]:
        return self.engine.adapter_paths()

    def served_models(self) -> list[ServedModel]:
        return [ServedModel(self.engine.facts, self.engine.tokenizer,
                            self.engine.adapter_paths())]

    async def load_adapter(self, name: str, path: str) -> None:
        if not await self.engine.add_adapter(name, path):
            raise InvalidRequest(f"lora_name: the LoRA adapter {name!r} is already loaded; "
                                 "unload it first to load it from another folder")

    async def unload_adapter(self, name: str) -> None:
        await self.engine.remove_adapter(name)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        params = vllm_params(req.sampling, req.max_tokens)
        stream = self.engine.generate(req.prompt_token_ids, params, req.request_id,
                                      self.engine.lora_request(req.lora))
        if req.sampling.n == 1:
            async for output in stream:
                yield delta_of_output(output)
            return
        choices = Choices()  # vLLM's parallel sampling: choice i samples with seed + i
        async for output in stream:
            for delta in choices.deltas(output):
                yield delta
