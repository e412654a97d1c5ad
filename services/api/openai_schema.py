"""OpenAI request bodies, their translation into pdserve's `GenerateRequest`, and
refusals as OpenAI error bodies with their HTTP status.

The HTTP front validates only what the gRPC API has no word for (`n`, the prompt's
OpenAI forms, fields pdserve does not implement); everything else is checked by
`services.api.prepare`, the one path every front end takes. Its errors name gRPC fields
(`sampling.max_tokens`); `openai_error` renames them to the fields the HTTP client sent
and maps the gRPC status to HTTP's.

The bodies accept what vLLM's OpenAI server accepts for these fields. Unknown fields
are ignored, as vLLM and OpenAI do; fields pdserve knows but cannot honour are refused
when set to anything but their default, so a request never silently means less.
"""

from __future__ import annotations

import re
from typing import Any, cast

from pydantic import BaseModel, ConfigDict

from pdserve.v1 import generate_pb2 as pb
from services.api.validation import invalid
from services.errors import http_status

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1

# Known fields pdserve cannot honour: refused unless left at a default.
UNSUPPORTED = ("best_of", "echo", "suffix", "logit_bias", "use_beam_search", "prompt_logprobs",
               "include_stop_str_in_output", "tools", "response_format", "logprob_token_ids")
_NEUTRAL: dict[str, tuple[Any, ...]] = {"best_of": (1,), "response_format": ({"type": "text"},)}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = False


class _Sampling(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int | None = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None  # accepted and ignored, as vLLM does
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: int | None = None


class ChatMessage(_Body):
    role: str
    # A string, or content parts of which only text parts can be served here.
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


def _int(name: str, value: int, low: int = -(2**31), high: int = INT32_MAX) -> int:
    if not low <= value <= high:
        raise invalid(f"{name}: {value} is out of range ({low}..{high})")
    return value


def _check_openai_only(body: _Sampling) -> None:
    if body.n not in (None, 1):
        raise invalid(f"n: {body.n} choices asked; pdserve returns exactly one (n=1)")
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED and value not in (None, False, "", [], {}, *_NEUTRAL.get(name, ())):
            raise invalid(f"{name}: not supported by pdserve; leave it unset")


def _sampling(body: _Sampling, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
    s = pb.SamplingParams(ignore_eos=body.ignore_eos,
                          min_tokens=_int("min_tokens", body.min_tokens))
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if (value := getattr(body, name)) is not None:
            setattr(s, name, value)
    if body.top_k is not None:
        s.top_k = _int("top_k", body.top_k)
    if max_tokens is not None:
        s.max_tokens = _int("max_tokens", max_tokens)
    if logprobs is not None:
        s.logprobs = _int("logprobs", logprobs)
    if body.seed is not None:
        s.seed = _int("seed", body.seed, 0, UINT64_MAX)
    s.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop or [])
    for i, t in enumerate(body.stop_token_ids or []):
        s.stop_token_ids.append(_int(f"stop_token_ids[{i}]", t))
    return s


def completion_request(body: CompletionRequest, request_id: str) -> pb.GenerateRequest:
    """The gRPC request for a completions body; raises InvalidRequest naming the field."""
    _check_openai_only(body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:  # a batch of prompts: one request each, in OpenAI's API
            raise invalid(f"prompt: {len(prompt)} prompts in one request; send one per request")
        prompt = prompt[0]
    req = pb.GenerateRequest(request_id=request_id, model=body.model or "")
    if isinstance(prompt, str):
        req.text = prompt
    else:
        ids = cast("list[int]", prompt)  # the one form left
        req.token_ids.ids.extend(_int(f"prompt[{i}]", t) for i, t in enumerate(ids))
        req.token_ids.SetInParent()  # an empty list is still the token-id form
    req.sampling.CopyFrom(_sampling(body, body.max_tokens, body.logprobs))
    return req


def _text_of(i: int, content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"messages[{i}].content[{j}]: only text parts are supported "
                          f"(got type {part.get('type')!r})")
        parts.append(part["text"])
    return "".join(parts)


def chat_request(body: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    """The gRPC request for a chat body; raises InvalidRequest naming the field."""
    _check_openai_only(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs: needs `logprobs: true`")
    req = pb.GenerateRequest(request_id=request_id, model=body.model or "")
    req.chat.SetInParent()
    for i, m in enumerate(body.messages):
        req.chat.messages.add(role=m.role, content=_text_of(i, m.content))
    max_tokens = body.max_completion_tokens or body.max_tokens  # vLLM's precedence
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    req.sampling.CopyFrom(_sampling(body, max_tokens, logprobs))
    return req


# -- errors ---------------------------------------------------------------------------
# Error `type`s as vLLM's OpenAI server names them.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError",
               504: "GatewayTimeoutError"}
_FIELD = re.compile(r"^([A-Za-z_][\w.]*)([\w.\[\]]*): ")  # name, then indices / subfields


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; `code` is the HTTP status, as in vLLM."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "InternalServerError"),
                      "param": param, "code": status}}


def openai_param(path: str, chat: bool) -> str:
    """The HTTP body's name for a gRPC field path (`sampling.top_p` -> `top_p`)."""
    prompt = "messages" if chat else "prompt"
    if path.startswith("sampling."):
        name = path.removeprefix("sampling.")
        return "top_logprobs" if chat and name == "logprobs" else name
    if path.startswith("chat.messages"):
        return path.removeprefix("chat.")
    if path in ("text", "token_ids.ids", "input", "prompt", "chat"):
        return prompt
    return path


def openai_error(err: BaseException, chat: bool) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body) for a refusal or failure. The leading field of a
    message is renamed to the HTTP body's name for it, which is also the `param`."""
    status, message = http_status(err)
    match = _FIELD.match(message)
    if match is None:
        return status, error_body(status, message)
    param = openai_param(match.group(1), chat) + match.group(2)
    return status, error_body(status, param + message[match.end(2):], param)
