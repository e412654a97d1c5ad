"""Request validation for the public API: pure functions, no engine, no sockets.

Every rejection names the field and says what is allowed, so a client can fix its
request without reading the server's code. The same checks serve every front end; the
checks of tokens and sampling that workers make too are `services/limits.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.v1 import generate_pb2 as pb
from services.errors import ModelNotFound
from services.limits import Limits, check_token_ids, invalid

MAX_CHAT_MESSAGES = 1024
MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class PromptInput:
    """The prompt in one of its three forms (exactly one is set)."""

    text: str | None = None
    chat: tuple[tuple[str, str], ...] | None = None
    token_ids: tuple[int, ...] | None = None


def check_model(requested: str, limits: Limits) -> None:
    if requested and requested != limits.served_model:
        raise ModelNotFound(
            f"model: {requested!r} is not served here; this server serves "
            f"{limits.served_model!r} (or leave `model` empty)")


def check_input(req: pb.GenerateRequest, limits: Limits) -> PromptInput:
    kind = req.WhichOneof("input")
    if kind is None:
        raise invalid("input: set one of `text`, `chat` or `token_ids`")
    if kind == "text":
        if not req.text.strip():
            raise invalid("text: the prompt is empty")
        return PromptInput(text=req.text)
    if kind == "chat":
        messages = req.chat.messages
        if not messages:
            raise invalid("chat.messages: at least one message is needed")
        if len(messages) > MAX_CHAT_MESSAGES:
            raise invalid(f"chat.messages: at most {MAX_CHAT_MESSAGES} messages")
        for i, m in enumerate(messages):
            if not m.role:
                raise invalid(f"chat.messages[{i}].role: empty (use system, user or assistant)")
        if not any(m.content.strip() for m in messages):
            raise invalid("chat.messages: every message is empty")
        return PromptInput(chat=tuple((m.role, m.content) for m in messages))
    ids = tuple(req.token_ids.ids)
    check_token_ids(ids, limits, "token_ids.ids")
    return PromptInput(token_ids=ids)


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters")
