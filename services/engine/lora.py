"""LoRA adapters: what names them at start (`--lora NAME=PATH`), the checks an adapter
folder passes before any engine sees it, and each engine's table of loaded adapters.

vLLM loads a PEFT folder when a request first uses it and fails that request (or, on
`add_lora`, raises from deep in the model worker) on anything it cannot apply. Here the
folder is read first, without torch: `adapter_config.json`, then the safetensors header
of `adapter_model.safetensors` against the base model's own weight shapes, so a bad
folder is the client's INVALID_ARGUMENT / HTTP 400 naming the problem, and the engine
never sees it.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.errors import InvalidRequest, ModelNotFound

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_NAME_CHARS = 128
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256)  # the max_lora_rank values vLLM takes
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
# A safetensors header larger than this is not one (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100 << 20
# PEFT's key of one LoRA matrix: base_model.model.<module>.lora_A.weight (or .lora_B.).
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?"
                       r"\.weight$")


class AdapterInvalid(InvalidRequest):
    """An adapter folder that cannot be served; the message names the problem."""


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapter named at start: `name` is what requests put in `model`."""

    name: str
    path: str


def check_name(name: str, field: str = "lora_name") -> str:
    if not name:
        raise InvalidRequest(f"{field}: required (the name requests will use as `model`)")
    if len(name) > MAX_NAME_CHARS or not _NAME.match(name):
        raise InvalidRequest(f"{field}: {name[:40]!r} must be 1..{MAX_NAME_CHARS} characters "
                             "of letters, digits and . _ : / -, starting with a letter or digit")
    return name


def parse_lora_modules(spec: str) -> list[LoraModule]:
    """The adapters of `--lora NAME=PATH` / `--lora-modules NAME=PATH ...`: entries
    separated by commas or whitespace. Raises ValueError naming the bad entry."""
    out: list[LoraModule] = []
    for entry in re.split(r"[,\s]+", spec.strip()):
        if not entry:
            continue
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {entry!r} is not NAME=PATH (for example "
                             "--lora sql=/adapters/sql-lora)")
        try:
            check_name(name, "lora_modules")
        except InvalidRequest as e:
            raise ValueError(e.message) from None
        if any(m.name == name for m in out):
            raise ValueError(f"lora_modules: adapter name {name!r} is given twice")
        out.append(LoraModule(name, path))
    return out


# -- the base model's shapes -----------------------------------------------------------
def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor table of a safetensors file (name -> dtype, shape, offsets), read from
    its header alone. Raises ValueError when the file is not safetensors."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", raw)
        if not 0 < size <= _MAX_HEADER_BYTES:
            raise ValueError(f"header length {size} is not a safetensors header's")
        data = f.read(size)
    if len(data) != size:
        raise ValueError("the header is cut short")
    try:
        header = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return header


@dataclass(frozen=True, slots=True)
class BaseModel:
    """What an adapter is checked against: the base model's linear weights by module
    path (`model.layers.0.self_attn.q_proj` -> [out, in]) and the names it goes by."""

    weights: dict[str, tuple[int, ...]]
    names: frozenset[str]  # lower-case names `base_model_name_or_path` may end with

    @classmethod
    def read(cls, model_path: Path, served_name: str = "") -> BaseModel:
        weights: dict[str, tuple[int, ...]] = {}
        for file in sorted(model_path.glob("*.safetensors")):
            for key, entry in safetensors_header(file).items():
                if key.endswith(".weight") and isinstance(entry, dict):
                    weights[key.removesuffix(".weight")] = tuple(entry.get("shape", ()))
        names = {model_path.name, served_name}
        # A prepared model's folder carries its dtype: SmolLM2-135M-Instruct-float32.
        names.add(re.sub(r"-(float32|float16|bfloat16|auto)$", "", model_path.name))
        config = model_path / "config.json"
        if config.is_file():
            try:
                named = json.loads(config.read_text()).get("_name_or_path") or ""
            except ValueError:
                named = ""
            names.add(str(named).rstrip("/").rsplit("/", 1)[-1])
        return cls(weights, frozenset(n.lower() for n in names if n))

    def module_names(self) -> set[str]:
        """Every dotted component of a module path: what `target_modules` may name."""
        return {part for path in self.weights for part in path.split(".")}


@dataclass(frozen=True, slots=True)
class AdapterFacts:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str  # as the adapter names it ("" = not named)


def _config(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise AdapterInvalid(f"lora_path: {folder} has no {CONFIG_FILE}; a LoRA adapter is a "
                             f"PEFT folder with {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterInvalid(f"lora_path: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterInvalid(f"lora_path: {CONFIG_FILE} is not a JSON object")
    return config


def _targets(config: dict[str, Any], base: BaseModel) -> tuple[str, ...]:
    targets = config.get("target_modules")
    known = base.module_names()
    if isinstance(targets, str):  # PEFT: a regular expression over module paths
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise AdapterInvalid(f"lora_path: {CONFIG_FILE}: target_modules {targets!r} is "
                                 f"not a regular expression ({e})") from None
        if not any(pattern.fullmatch(path) for path in base.weights):
            raise AdapterInvalid(f"lora_path: {CONFIG_FILE}: target_modules {targets!r} "
                                 "matches no module of the base model")
        return (targets,)
    if (not isinstance(targets, list) or not targets
            or not all(isinstance(t, str) and t for t in targets)):
        raise AdapterInvalid(f"lora_path: {CONFIG_FILE}: target_modules must be a non-empty "
                             "list of module names (such as [\"q_proj\", \"v_proj\"])")
    missing = [t for t in targets if t not in known]
    if missing:
        raise AdapterInvalid(f"lora_path: {CONFIG_FILE}: target_modules {missing} do not exist "
                             "in the base model (its linear modules include "
                             f"{sorted(n for n in known if n.endswith('_proj'))[:8]})")
    return tuple(targets)


def check_adapter(path: str, base: BaseModel, max_lora_rank: int) -> AdapterFacts:
    """Check an adapter folder against the base model and the engine's rank limit;
    `AdapterInvalid` names the first problem found."""
    if not path:
        raise AdapterInvalid("lora_path: required (the adapter's folder on the server)")
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterInvalid(f"lora_path: {path!r} is not a folder on the server")
    config = _config(folder)
    peft_type = str(config.get("peft_type", ""))
    if peft_type.upper() != "LORA":
        raise AdapterInvalid(f"lora_path: {CONFIG_FILE}: peft_type is {peft_type!r}; only "
                             "LORA adapters are served")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterInvalid(f"lora_path: {CONFIG_FILE}: r (the rank) is {rank!r}, not a "
                             "whole number >= 1")
    if rank > max_lora_rank:
        raise AdapterInvalid(f"lora_path: the adapter's rank {rank} is above the engines' "
                             f"max_lora_rank {max_lora_rank}; restart them with "
                             f"--max-lora-rank {rank} or more")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise AdapterInvalid(f"lora_path: {CONFIG_FILE}: lora_alpha {alpha!r} is not a number")
    named = str(config.get("base_model_name_or_path") or "")
    short = named.rstrip("/").rsplit("/", 1)[-1].lower()
    if short and short not in base.names:
        raise AdapterInvalid(f"lora_path: the adapter was made for {named!r}, not the served "
                             f"base model ({sorted(base.names)[0]}); adapters only apply to "
                             "the model they were trained on")
    targets = _targets(config, base)
    _check_weights(folder, rank, base)
    return AdapterFacts(rank, float(alpha), targets, named)


def _check_weights(folder: Path, rank: int, base: BaseModel) -> None:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        extra = (" (adapter_model.bin is not loaded: convert it to safetensors)"
                 if (folder / "adapter_model.bin").exists() else "")
        raise AdapterInvalid(f"lora_path: {folder} has no {WEIGHTS_FILE}{extra}")
    try:
        header = safetensors_header(file)
    except (OSError, ValueError) as e:
        raise AdapterInvalid(f"lora_path: {WEIGHTS_FILE} is not a safetensors file ({e})"
                             ) from None
    seen: dict[str, set[str]] = {}
    for key, entry in header.items():
        m = _LORA_KEY.match(key)
        if m is None:
            continue  # e.g. modules_to_save; vLLM decides about those
        module, ab = m.group("module"), m.group("ab")
        shape = tuple(entry.get("shape", ())) if isinstance(entry, dict) else ()
        if module not in base.weights:
            raise AdapterInvalid(f"lora_path: {WEIGHTS_FILE}: {key} adapts {module}, which the "
                                 "base model does not have")
        out_dim, in_dim = (base.weights[module] + (0, 0))[:2]
        want = (rank, in_dim) if ab == "A" else (out_dim, rank)
        if shape != want:
            raise AdapterInvalid(f"lora_path: {WEIGHTS_FILE}: {key} has shape {list(shape)}, "
                                 f"expected {list(want)} (rank {rank}, base weight "
                                 f"[{out_dim}, {in_dim}])")
        seen.setdefault(module, set()).add(ab)
    if not seen:
        raise AdapterInvalid(f"lora_path: {WEIGHTS_FILE} holds no LoRA weights (keys such as "
                             "base_model.model.<module>.lora_A.weight)")
    half = sorted(m for m, ab in seen.items() if ab != {"A", "B"})
    if half:
        raise AdapterInvalid(f"lora_path: {WEIGHTS_FILE}: {half[0]} has only one of lora_A "
                             "and lora_B")


# -- one engine's adapters -------------------------------------------------------------
class AdapterTable:
    """The adapters one engine serves: name -> (vLLM's integer id, path). Ids are never
    reused, so a request still running under an unloaded adapter's id never meets a new
    adapter's weights under it."""

    def __init__(self) -> None:
        self._by_name: dict[str, tuple[int, str]] = {}
        self._next_id = 1

    def paths(self) -> dict[str, str]:
        return {name: path for name, (_, path) in sorted(self._by_name.items())}

    def get(self, name: str) -> tuple[int, str] | None:
        return self._by_name.get(name)

    def add(self, name: str, path: str) -> int:
        lora_id = self._next_id
        self._next_id += 1
        self._by_name[name] = (lora_id, path)
        return lora_id

    def remove(self, name: str) -> int:
        entry = self._by_name.pop(name, None)
        if entry is None:
            raise ModelNotFound(f"lora_name: the LoRA adapter {name!r} is not loaded here")
        return entry[0]
