"""The models a server serves, and which one a request names.

A backend serves one or more base models, the first being the default; each may have
LoRA adapters. A request's `model` names a base model, an adapter (which runs on its
base model) or nothing (the default model). Both fronts resolve it here, so an unknown
name gets the same NOT_FOUND, listing what is served, on gRPC and HTTP alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services import limits as model_limits
from services.engine.engine import ModelFacts
from services.errors import ModelNotFound

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ServedModel:
    """One base model: what clients are told about it, the tokenizer its prompts are
    rendered with, and its LoRA adapters (name -> folder)."""

    facts: ModelFacts
    tokenizer: PreTrainedTokenizerBase
    adapters: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def limits(self) -> model_limits.Limits:
        f = self.facts
        return model_limits.Limits(f.name, f.max_model_len, f.vocab_size)


@dataclass(frozen=True)
class Resolved:
    """What a request's `model` names: the base model it runs on and its adapter
    ("" = none)."""

    model: ServedModel
    lora: str = ""

    @property
    def name(self) -> str:
        """The name answers carry: the adapter's, else the base model's."""
        return self.lora or self.model.name


def served_names(models: Sequence[ServedModel]) -> list[str]:
    """Every name a request may give as `model`: base models, then their adapters."""
    return [m.name for m in models] + [a for m in models for a in m.adapters]


def resolve(models: Sequence[ServedModel], requested: str) -> Resolved:
    """The model `requested` names ("" = the default, the first of `models`);
    `ModelNotFound` listing the served names when it names none of them."""
    if not models:
        raise ModelNotFound("model: no model is served yet; try again once the server "
                            "has started")
    if not requested:
        return Resolved(models[0])
    for m in models:
        if requested == m.name:
            return Resolved(m)
    for m in models:
        if requested in m.adapters:
            return Resolved(m, requested)
    shown = ", ".join(repr(n) for n in served_names(models))
    raise ModelNotFound(f"model: {requested!r} is not served here; this server serves "
                        f"{shown} (or leave `model` empty for {models[0].name!r})")
