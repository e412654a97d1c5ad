"""docs/configuration.md is generated from the settings models and kept fresh."""

from __future__ import annotations

from pathlib import Path

from services.config_doc import markdown_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_is_fresh() -> None:
    assert DOC.read_text() == markdown_reference(), (
        "docs/configuration.md is stale: run `python -m services.config_doc > "
        "docs/configuration.md`")
