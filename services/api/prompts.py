"""Turn the three prompt forms into token ids, the way vLLM's own servers do."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from services.api.validation import PromptInput, invalid

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pdserve.v1 import generate_pb2 as pb


def _json_object(field: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise invalid(f"{field}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise invalid(f"{field}: must be a JSON object")
    return value


def chat_messages(chat: pb.ChatInput) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools as a chat template reads them (vLLM's chat endpoint's form:
    OpenAI's, with each call's arguments as a mapping, as Transformers' templates expect)."""
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(chat.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.name,
                    "arguments": _json_object(
                        f"chat.messages[{i}].tool_calls[{j}].arguments", c.arguments)
                    if c.arguments else {}}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    tools = [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description else {}),
        **({"parameters": _json_object(f"chat.tools[{k}].parameters", t.parameters)}
           if t.parameters else {})}} for k, t in enumerate(chat.tools)]
    return messages, tools or None


def render(prompt: PromptInput, tokenizer: PreTrainedTokenizerBase,
           chat: pb.ChatInput | None = None) -> list[int]:
    """The prompt's token ids; a chat prompt's tools and tool calls come from `chat`."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    if prompt.text is not None:
        # Same as vLLM's offline `LLM.generate(text)`: special tokens (BOS) added.
        return list(tokenizer.encode(prompt.text))
    assert prompt.chat is not None
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("chat: this model has no chat template; send `text` or `token_ids`")
    tools = None
    if chat is not None:
        messages, tools = chat_messages(chat)
    else:
        messages = [{"role": role, "content": content} for role, content in prompt.chat]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False,
            **({"tools": tools} if tools else {}))
    except Exception as e:  # template errors are the client's (e.g. bad role order)
        raise invalid(f"chat: the model's chat template refused the messages: {e}") from e
    # The template already holds the special tokens (as in vLLM's chat endpoint).
    return list(tokenizer.encode(str(text), add_special_tokens=False))
