"""Turn the three prompt forms into token ids, the way vLLM's own servers do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.api.validation import PromptInput, invalid

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def render(prompt: PromptInput, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    if prompt.text is not None:
        # Same as vLLM's offline `LLM.generate(text)`: special tokens (BOS) added.
        return list(tokenizer.encode(prompt.text))
    assert prompt.chat is not None
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("chat: this model has no chat template; send `text` or `token_ids`")
    messages = [{"role": role, "content": content} for role, content in prompt.chat]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # template errors are the client's (e.g. bad role order)
        raise invalid(f"chat: the model's chat template refused the messages: {e}") from e
    # The template already holds the special tokens (as in vLLM's chat endpoint).
    return list(tokenizer.encode(str(text), add_special_tokens=False))
