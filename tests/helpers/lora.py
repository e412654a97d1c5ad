"""Write LoRA adapters for tests: a PEFT folder (`adapter_config.json` and
`adapter_model.safetensors`) for any safetensors base model, with seeded random A and B
matrices (B non-zero, unlike a freshly initialised PEFT adapter, so the adapter changes
what the model says). For SmolLM2-135M with q_proj and v_proj at rank 8 the matrices are
A [8, 576] and B [576, 8] (q) or [192, 8] (v), in each of the 30 layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from services.engine.lora import BaseModel

BASE_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
TARGETS = ("q_proj", "v_proj")


def write_adapter(folder: Path, model_path: Path, *, rank: int = 8, alpha: int = 16,
                  targets: tuple[str, ...] = TARGETS, seed: int = 0, scale: float = 0.2,
                  base_model: str = BASE_MODEL_NAME, tensor_rank: int | None = None,
                  config: dict[str, Any] | None = None) -> Path:
    """A PEFT LoRA folder for the model at `model_path`. `scale` is the spread of B's
    entries (A's is 1/sqrt(in_features)). `tensor_rank` writes matrices of another rank
    than the config's `r` (a broken adapter); `config` overrides keys of
    adapter_config.json (a value None removes the key)."""
    from safetensors.numpy import save_file

    base = BaseModel.read(model_path)
    rng = np.random.default_rng(seed)
    r = tensor_rank or rank
    tensors: dict[str, np.ndarray] = {}
    for module, shape in sorted(base.weights.items()):
        if module.rsplit(".", 1)[-1] not in targets or len(shape) != 2:
            continue
        out_dim, in_dim = shape
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = (
            rng.standard_normal((r, in_dim)) / np.sqrt(in_dim)).astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = (
            rng.standard_normal((out_dim, r)) * scale).astype(np.float32)
    if not tensors:
        raise ValueError(f"the model at {model_path} has no modules named {targets}")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none",
        "base_model_name_or_path": base_model, "fan_in_fan_out": False,
        "inference_mode": True,
    }
    for key, value in (config or {}).items():
        if value is None:
            settings.pop(key, None)
        else:
            settings[key] = value
    (folder / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    return folder
