"""`--speculative-config`: vLLM's JSON, checked when the settings are read (pure logic)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.engine.config import EngineConfig


def test_off_by_default() -> None:
    assert EngineConfig().speculative() is None


def test_ngram_passes_through_as_vllm_takes_it() -> None:
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    assert cfg.speculative() == {"method": "ngram", "num_speculative_tokens": 4}


@pytest.mark.parametrize(("value", "words"), [
    ("ngram", "is not JSON"),
    ("[1, 2]", "JSON object naming"),
    ('{"num_speculative_tokens": 4}', "JSON object naming"),
    ('{"method": "eagle", "model": "drafts/eagle"}', "needs a GPU"),
    ('{"model": "drafts/small"}', "needs a GPU"),
])
def test_refused_in_words(value: str, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        EngineConfig(speculative_config=value)
