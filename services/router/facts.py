"""What the router tells clients about the served model: the workers' model, read from
the view, and the tokenizer it renders prompts with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from services.engine.engine import ModelFacts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def model_facts(tokenizer: PreTrainedTokenizerBase, model_path: str, model: str,
                max_model_len: int, vocab_size: int, dtype: str) -> ModelFacts:
    eos = tokenizer.eos_token_id
    return ModelFacts(
        name=model, path=Path(model_path), max_model_len=max_model_len, vocab_size=vocab_size,
        eos_token_ids=(eos,) if eos is not None else (), bos_token_id=tokenizer.bos_token_id,
        has_chat_template=bool(tokenizer.chat_template), tokenizer_class=type(tokenizer).__name__,
        dtype=dtype)
