"""The models a `pdserve up` stack serves, each with its own prefill and decode pools.

The stack's own settings (`--model`, `--served-model-name`, `--prefill`, `--decode`, the
engine's) describe its first model, the default one; `--add-model` (repeatable) or the
settings file's `launcher.models` list adds more, each entry with its own pool sizes and,
where it differs, its own context length, KV cache size and tensor-parallel size:

    pdserve up --prefill 1 --decode 2 \\
        --add-model model=/models/llama,name=llama,prefill=1,decode=1,max_model_len=4096

Each model's workers register under its name; the router pairs a request only among
the workers of the model it names (`services/router/catalog.py`). `pdserve scale` and
the live planner change the default model's pools; the others keep the sizes given here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from services.engine.config import EngineConfig
from services.engine.model import default_model_path

ROLES = ("prefill", "decode")


class ModelPool(BaseModel):
    """One more model of the stack: its folder, its name and its pools."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="HF-format model folder")
    name: str = Field("", description="the name requests give as `model`; empty = the "
                      "folder's name")
    prefill: int = Field(1, ge=0, description="prefill workers of this model")
    decode: int = Field(1, ge=1, description="decode workers of this model")
    max_model_len: int = Field(0, ge=0, description="its context length; 0 = the stack's "
                               "--max-model-len")
    kv_cache_gib: int = Field(0, ge=0, description="CPU: each of its workers' KV cache in "
                              "GiB; 0 = the stack's --kv-cache-gib")
    tp: int = Field(0, ge=0, description="tensor-parallel ranks of each of its workers; 0 = "
                    "the stack's")

    @property
    def served_name(self) -> str:
        return self.name or Path(self.model).expanduser().name

    def engine(self, stack: EngineConfig) -> EngineConfig:
        """Its workers' engine settings: the stack's, with this model's own. LoRA adapters
        given at start belong to the default model, so this one starts without them."""
        update: dict[str, object] = {"model": self.model, "served_model_name": self.served_name,
                                     "lora_modules": ""}
        if self.max_model_len:
            update["max_model_len"] = self.max_model_len
        if self.kv_cache_gib:
            update["kv_cache_gib"] = self.kv_cache_gib
        if self.tp:
            update["tensor_parallel_size"] = self.tp
        return stack.model_copy(update=update)


def default_served_name(engine: EngineConfig) -> str:
    """The name the stack's own model is served under (as its engine names it)."""
    if engine.served_model_name:
        return engine.served_model_name
    return default_folder(engine).name


def default_folder(engine: EngineConfig) -> Path:
    """The folder of the stack's own model: --model, else the prepared default model."""
    if engine.model:
        return Path(engine.model).expanduser()
    return default_model_path(engine.resolved_dtype())


class ModelsRefused(ValueError):
    """Models a stack cannot serve; the message says which and what to do."""


def check_models(engine: EngineConfig, models: list[ModelPool], planner: bool = False) -> None:
    """Refuse what cannot run: two models under one name, a folder that is no model, the
    live planner (it plans one model's pools) beside more models. `ModelsRefused` says
    which entry and what to do."""
    if models and planner:
        raise ModelsRefused("the live planner (--planner-profile) plans the pools of one "
                            "model: run it on a stack without --add-model, or size each "
                            "model's pools yourself")
    names = [default_served_name(engine)]
    for i, m in enumerate(models):
        if m.served_name in names:
            raise ModelsRefused(f"models[{i}]: the name {m.served_name!r} is served already; "
                             "give this model another with name=NAME")
        names.append(m.served_name)
        if not (Path(m.model).expanduser() / "config.json").is_file():
            raise ModelsRefused(f"models[{i}]: {m.model} holds no HF-format model (config.json "
                             "missing)")


@dataclass(frozen=True, slots=True)
class Pool:
    """One role's pool of one model, as the supervisor keeps it: `key` names its actors
    (`{key}-{index}`). The default model's pools are plain `prefill` and `decode`, as in
    a one-model stack; model k (from 1) of `models` has `m{k}-prefill` and `m{k}-decode`."""

    key: str
    role: str
    model: int  # 0: the default model; k: models[k - 1]

    @classmethod
    def parse(cls, key: str) -> Pool:
        found = re.fullmatch(r"(?:m(\d+)-)?(prefill|decode)", key)
        if found is None:
            raise ValueError(f"not a worker pool: {key!r}")
        return cls(key, found.group(2), int(found.group(1) or 0))


def extra_pools(models: list[ModelPool]) -> list[tuple[Pool, int]]:
    """The pools of the models beyond the default, with their sizes."""
    return [(Pool(f"m{k}-{role}", role, k), getattr(m, role))
            for k, m in enumerate(models, start=1) for role in ROLES]
