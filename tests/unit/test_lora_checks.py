"""LoRA adapter folders are checked before any engine sees them: each problem is an
INVALID_ARGUMENT naming it. The base model here is a small safetensors folder with a
Llama's module names (two layers, hidden 32, KV 16), written by the test."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from services.engine.config import EngineConfig
from services.engine.lora import (
    AdapterInvalid,
    AdapterTable,
    BaseModel,
    check_adapter,
    parse_lora_modules,
    safetensors_header,
)
from services.errors import ModelNotFound
from services.settings import add_arguments, from_arguments
from tests.helpers.lora import write_adapter

HIDDEN, KV, FFN = 32, 16, 64


@pytest.fixture(scope="module")
def base_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.numpy import save_file

    folder = tmp_path_factory.mktemp("base") / "SmolLM2-135M-Instruct-float32"
    folder.mkdir()
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN),
              "self_attn.v_proj": (KV, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
              "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN),
              "mlp.down_proj": (HIDDEN, FFN)}
    tensors = {f"model.layers.{i}.{name}.weight": np.zeros(shape, np.float32)
               for i in range(2) for name, shape in shapes.items()}
    tensors["model.embed_tokens.weight"] = np.zeros((100, HIDDEN), np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"hidden_size": HIDDEN}))
    return folder


@pytest.fixture(scope="module")
def base(base_path: Path) -> BaseModel:
    return BaseModel.read(base_path, "SmolLM2-135M-Instruct-float32")


def refusal(path: Path, base: BaseModel, max_rank: int = 16) -> str:
    with pytest.raises(AdapterInvalid) as err:
        check_adapter(str(path), base, max_rank)
    assert err.value.message.startswith("lora_path:"), err.value.message
    return err.value.message


def test_a_good_adapter_passes(tmp_path: Path, base_path: Path, base: BaseModel) -> None:
    folder = write_adapter(tmp_path / "good", base_path, rank=8, alpha=16)
    facts = check_adapter(str(folder), base, 16)
    assert (facts.rank, facts.alpha, facts.target_modules) == (8, 16.0, ("q_proj", "v_proj"))
    header = safetensors_header(folder / "adapter_model.safetensors")
    assert header["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"][
        "shape"] == [KV, 8]


def test_the_base_model_goes_by_its_hub_name(tmp_path: Path, base_path: Path,
                                             base: BaseModel) -> None:
    """A prepared model's folder ends in its dtype; adapters name the hub's model."""
    for named in ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct", ""):
        folder = write_adapter(tmp_path / f"n{len(named)}", base_path, base_model=named)
        check_adapter(str(folder), base, 16)


@pytest.mark.parametrize("change, words", [
    ({"peft_type": "PREFIX_TUNING"}, "peft_type is 'PREFIX_TUNING'"),
    ({"r": 32}, "rank 32 is above the engines' max_lora_rank 16"),
    ({"r": 0}, "r (the rank) is 0"),
    ({"target_modules": ["q_proj", "attn_proj"]}, "['attn_proj'] do not exist"),
    ({"target_modules": []}, "target_modules must be a non-empty list"),
    ({"target_modules": "(unclosed"}, "is not a regular expression"),
    ({"base_model_name_or_path": "meta-llama/Llama-2-7b-hf"}, "made for 'meta-llama/Llama-2"),
    ({"lora_alpha": "high"}, "lora_alpha 'high' is not a number"),
])
def test_bad_configs_are_named(tmp_path: Path, base_path: Path, base: BaseModel,
                               change: dict[str, object], words: str) -> None:
    rank = change["r"] if isinstance(change.get("r"), int) and change["r"] else 8
    folder = write_adapter(tmp_path / "bad", base_path, rank=int(str(rank)),
                           config=change)
    assert words in refusal(folder, base)


def test_weights_of_another_rank_than_the_config_are_refused(
        tmp_path: Path, base_path: Path, base: BaseModel) -> None:
    folder = write_adapter(tmp_path / "shape", base_path, rank=8, tensor_rank=4)
    message = refusal(folder, base)
    assert "has shape [4, 32], expected [8, 32]" in message


def test_weights_for_another_model_are_refused(tmp_path: Path, base_path: Path,
                                               base: BaseModel) -> None:
    from safetensors.numpy import save_file

    folder = write_adapter(tmp_path / "other", base_path)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": np.ones((8, 48), np.float32),
               f"{key}.lora_B.weight": np.ones((32, 8), np.float32)},
              str(folder / "adapter_model.safetensors"))
    assert "expected [8, 32]" in refusal(folder, base)
    save_file({"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight":
               np.ones((8, 32), np.float32)}, str(folder / "adapter_model.safetensors"))
    assert "the base model does not have" in refusal(folder, base)
    save_file({f"{key}.lora_A.weight": np.ones((8, 32), np.float32)},
              str(folder / "adapter_model.safetensors"))
    assert "has only one of lora_A and lora_B" in refusal(folder, base)


def test_missing_and_unreadable_files_are_named(tmp_path: Path, base_path: Path,
                                                base: BaseModel) -> None:
    assert "is not a folder" in refusal(tmp_path / "nowhere", base)
    folder = write_adapter(tmp_path / "files", base_path)
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    assert "is not a safetensors file" in refusal(folder, base)
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.bin").write_bytes(b"")
    assert "convert it to safetensors" in refusal(folder, base)
    (folder / "adapter_config.json").write_text("{not json")
    assert "adapter_config.json is not JSON" in refusal(folder, base)
    (folder / "adapter_config.json").unlink()
    assert "has no adapter_config.json" in refusal(folder, base)
    with pytest.raises(AdapterInvalid, match="lora_path: required"):
        check_adapter("", base, 16)


def test_lora_modules_parse_and_refuse_in_words() -> None:
    assert [(m.name, m.path) for m in parse_lora_modules("a=/x, b=/y c=/z")] == [
        ("a", "/x"), ("b", "/y"), ("c", "/z")]
    assert parse_lora_modules("  ") == []
    for spec, words in (("a", "is not NAME=PATH"), ("=/x", "is not NAME=PATH"),
                        ("a=/x,a=/y", "given twice"), ("-a=/x", "must be 1..128")):
        with pytest.raises(ValueError, match=words):
            parse_lora_modules(spec)
    with pytest.raises(ValueError, match="is not NAME=PATH"):
        EngineConfig(lora_modules="oops")


def test_flags_take_both_spellings_repeated() -> None:
    """--lora NAME=PATH repeated, and vLLM's --lora-modules with several values."""
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    args = parser.parse_args(["--lora", "a=/x", "--lora-modules", "b=/y", "c=/z",
                              "--lora", "d=/w", "--max-lora-rank", "8", "--max-loras", "2"])
    config = from_arguments(EngineConfig, args)
    assert config.lora_modules == "a=/x,b=/y,c=/z,d=/w"
    assert (config.max_lora_rank, config.max_loras, config.lora_enabled) == (8, 2, True)
    none = from_arguments(EngineConfig, parser.parse_args([]))
    assert not none.lora_enabled
    assert from_arguments(EngineConfig, parser.parse_args(["--enable-lora"])).lora_enabled
    with pytest.raises(ValueError, match="not one of vLLM's ranks"):
        from_arguments(EngineConfig, parser.parse_args(["--max-lora-rank", "12"]))
    env = {"PDSERVE_MAX_LORA_RANK": "32", "PDSERVE_LORA_MODULES": "a=/x b=/y"}
    with pytest.MonkeyPatch.context() as mp:  # as a local pair's workers get them
        for key, value in env.items():
            mp.setenv(key, value)
        config = EngineConfig()
    assert (config.max_lora_rank, config.lora_modules) == (32, "a=/x b=/y")


def test_adapter_ids_are_never_reused() -> None:
    table = AdapterTable()
    assert table.add("a", "/x") == 1
    assert table.remove("a") == 1
    assert table.add("a", "/x") == 2
    assert table.add("b", "/y") == 3
    assert table.paths() == {"a": "/x", "b": "/y"}
    with pytest.raises(ModelNotFound):
        table.remove("c")
