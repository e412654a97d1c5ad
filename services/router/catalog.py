"""The models a router serves, and which workers serve each.

A router serves one model (the name its workers register, the tokenizer it was given)
or several (`router_models`: each name with its tokenizer folder, the default first).
Each model's workers are its pool: a request is paired among the workers of the model
it names, never across models (their KV layouts differ, and so would their answers).
What clients are told about a model comes from its first worker seen.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.engine.engine import ModelFacts
from services.errors import ModelNotFound
from services.registry.records import WorkerRecord
from services.router.facts import model_facts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# The key of the one model of a router that was told no names: its workers tell it.
ONE = ""


class Catalog:
    """name -> (tokenizer, folder) of each served model, in order (the default first),
    and the facts of each once a worker of it is seen."""

    def __init__(self, sources: Sequence[tuple[str, PreTrainedTokenizerBase, str]]) -> None:
        self.sources = {name: (tok, path) for name, tok, path in sources}
        self.facts: dict[str, ModelFacts] = {}
        self._strays: set[str] = set()  # model names workers register that are not served

    @classmethod
    def one(cls, tokenizer: PreTrainedTokenizerBase, path: str) -> Catalog:
        """One model, under whatever name its workers register."""
        return cls([(ONE, tokenizer, path)])

    @property
    def default(self) -> str:
        return next(iter(self.sources))

    @property
    def several(self) -> bool:
        return len(self.sources) > 1

    def key(self, model: str) -> str:
        """The key of the model a request's `model` names ("" = the default)."""
        if not model or ONE in self.sources:
            return self.default
        return model

    def served(self, model: str) -> str:
        """The key of `model` if it is served here; `ModelNotFound` naming those that are
        otherwise."""
        key = self.key(model)
        if key not in self.sources:
            names = ", ".join(repr(m) for m in self.sources)
            raise ModelNotFound(f"model: {model!r} is not served here; this router serves "
                                f"{names}")
        return key

    def tokenizer(self, key: str) -> PreTrainedTokenizerBase:
        return self.sources[key][0]

    def pool(self, view: Sequence[WorkerRecord], key: str) -> list[WorkerRecord]:
        """The workers of the model under `key`."""
        if ONE in self.sources:
            name = self.facts[ONE].name if ONE in self.facts else None
            return [w for w in view if name is None or w.model == name]
        return [w for w in view if w.model == key]

    def learn(self, view: Sequence[WorkerRecord]) -> None:
        """Each model's facts from its first worker seen (a decode worker preferred);
        workers of a model not served here are named once."""
        for w in sorted(view, key=lambda w: w.role != "decode"):
            key = ONE if ONE in self.sources else w.model
            if key in self.facts:
                continue
            if key not in self.sources:
                if w.model not in self._strays:
                    self._strays.add(w.model)
                    log.warning("worker %s serves model %r, which this router does not "
                                "serve (router_models: %s): it gets no requests",
                                w.worker_id, w.model, ", ".join(self.sources))
                continue
            tokenizer, path = self.sources[key]
            self.facts[key] = model_facts(tokenizer, path, w.model, w.max_model_len,
                                          w.vocab_size, w.dtype)

    def without_decode(self, view: Sequence[WorkerRecord]) -> list[str]:
        """The served models no decode worker is registered for."""
        return [m for m in self.sources
                if not any(w.role == "decode" for w in self.pool(view, m))]
