"""Which tokenizer a run without --tokenizer uses: the served model's (folders on disk,
no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.bench.served_tokenizer import tokenizer_folder


def model_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_a_served_local_folder_is_its_own_tokenizer(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "my-model")
    assert tokenizer_folder(str(folder)) == folder


def test_a_prepared_pdserve_model_is_found_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_MODELS_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)
    folder = model_folder(tmp_path / "SmolLM2-135M-Instruct-float32")
    assert tokenizer_folder("SmolLM2-135M-Instruct-float32") == folder


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B-Instruct", "renamed", ""])
def test_a_model_with_no_local_tokenizer_says_to_pass_one(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_MODELS_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "renamed").mkdir()  # a folder, but with no tokenizer in it
    with pytest.raises(ValueError, match="pass --tokenizer MODEL_DIR"):
        tokenizer_folder(model)
