"""OpenAI request bodies, their translation into pdserve's `GenerateRequest`, and
refusals as OpenAI error bodies with their HTTP status.

The HTTP front validates only what the gRPC API has no word for (the prompt's
OpenAI forms, fields pdserve does not implement); everything else is checked by
`services.api.prepare`, the one path every front end takes. Its errors name gRPC fields
(`sampling.max_tokens`); `openai_error` renames them to the fields the HTTP client sent
and maps the gRPC status to HTTP's.

The bodies accept what vLLM's OpenAI server accepts for these fields. Unknown fields
are ignored, as vLLM and OpenAI do; fields pdserve knows but cannot honour are refused
when set to anything but their default, so a request never silently means less.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, cast

from pydantic import BaseModel, ConfigDict

from pdserve.v1 import generate_pb2 as pb
from services.api import tools
from services.api.validation import invalid
from services.errors import http_status

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1

# Known fields pdserve cannot honour: refused unless left at a default (docs/openai-api.md
# says why for each).
UNSUPPORTED = ("best_of", "suffix", "use_beam_search", "prompt_logprobs", "logprob_token_ids")
CHAT_UNSUPPORTED = ("echo",)  # chat's echo (prepend the last message); completions' is served
_NEUTRAL: dict[str, tuple[Any, ...]] = {"best_of": (1,)}
LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps each bias to [-100, 100], as OpenAI documents
# vLLM's `structured_outputs` keys: the constraint kinds (as the gRPC field names them),
# and options pdserve does not pass on (refused unless left at their default).
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "json_object": "json_object"}
STRUCTURED_UNSUPPORTED = ("structural_tag", "disable_any_whitespace",
                          "disable_additional_properties", "whitespace_pattern")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk as well


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
    # Output constraints: OpenAI's `response_format`, or vLLM's `structured_outputs`.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias
    include_stop_str_in_output: bool = False

    @property
    def structured_param(self) -> str:
        """The body field the output constraint came in (names it in errors)."""
        return "structured_outputs" if self.structured_outputs else "response_format"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk too; as in vLLM, only with `include_usage`."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: int | None = None
    echo: bool | None = False  # the answer starts with the prompt


class ChatMessage(_Body):
    role: str
    # A string, or content parts of which only text parts can be served here.
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @property
    def structured_param(self) -> str:
        if self.tools is not None and (self.tool_choice == "required"
                                       or isinstance(self.tool_choice, dict)):
            return "tools"  # the constraint is the tools' schema
        return super().structured_param


def _int(name: str, value: int, low: int = -(2**31), high: int = INT32_MAX) -> int:
    if not low <= value <= high:
        raise invalid(f"{name}: {value} is out of range ({low}..{high})")
    return value


def _check_openai_only(body: _Sampling, refused: tuple[str, ...] = UNSUPPORTED) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in refused and value not in (None, False, "", [], {}, *_NEUTRAL.get(name, ())):
            raise invalid(f"{name}: not supported by pdserve; leave it unset")


def _logit_bias(raw: dict[str, float]) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as keys), each bias clamped as vLLM does; the ids
    are checked against the vocabulary with the rest of the sampling."""
    out = {}
    for key, bias in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(f"logit_bias: key {key!r} is not a token id") from None
        if not math.isfinite(bias):
            raise invalid(f"logit_bias: the bias of token {key} must be a finite number")
        out[_int("logit_bias", token)] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias))
    return out


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
    if body.n is not None and body.n != 1:
        s.n = _int("n", body.n, 0, INT32_MAX)  # its range is checked with the sampling
    s.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop or [])
    for i, t in enumerate(body.stop_token_ids or []):
        s.stop_token_ids.append(_int(f"stop_token_ids[{i}]", t))
    structured = _structured(body)
    if structured is not None:
        s.structured.CopyFrom(structured)
    if body.logit_bias:
        s.logit_bias.update(_logit_bias(body.logit_bias))
    s.include_stop_str_in_output = body.include_stop_str_in_output
    return s


def _schema_text(name: str, schema: Any) -> str:
    if isinstance(schema, str):
        return schema  # JSON text; compile-checked with the rest
    if not isinstance(schema, dict):
        raise invalid(f"{name}: a JSON schema is an object")
    return json.dumps(schema)


def _structured(body: _Sampling) -> pb.StructuredOutput | None:
    """The output constraint of `response_format` or `structured_outputs` (one only)."""
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.get("type", "text") != "text":
        if so:
            raise invalid("response_format: set either response_format or "
                          "structured_outputs, not both")
        kind = fmt.get("type")
        if kind == "json_object":
            return pb.StructuredOutput(json_object=True)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or spec.get("schema") is None:
                raise invalid("response_format.json_schema.schema: required with type "
                              "json_schema (the JSON schema the answer must validate)")
            return pb.StructuredOutput(json_schema=_schema_text(
                "response_format.json_schema.schema", spec["schema"]))
        raise invalid(f"response_format.type: {kind!r} is not supported; use text, "
                      "json_object or json_schema")
    if not so:
        return None
    for key in STRUCTURED_UNSUPPORTED:
        if so.get(key) not in (None, False, ""):
            raise invalid(f"structured_outputs.{key}: not supported by pdserve; leave it unset")
    kinds = [k for k in STRUCTURED_KINDS if so.get(k) is not None]
    if len(kinds) != 1:
        raise invalid("structured_outputs: set exactly one of json, regex, choice, grammar "
                      f"or json_object (got {', '.join(kinds) or 'none'})")
    key = kinds[0]
    value = so[key]
    if key == "json":
        return pb.StructuredOutput(json_schema=_schema_text("structured_outputs.json", value))
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise invalid("structured_outputs.choice: a list of strings")
        return pb.StructuredOutput(choice=pb.Choices(choices=value))
    if key == "json_object":
        if value is not True:
            raise invalid("structured_outputs.json_object: must be true when set")
        return pb.StructuredOutput(json_object=True)
    if not isinstance(value, str):
        raise invalid(f"structured_outputs.{key}: a string")
    out = pb.StructuredOutput()
    setattr(out, key, value)
    return out


def completion_request(body: CompletionRequest, request_id: str) -> pb.GenerateRequest:
    """The gRPC request for a completions body; raises InvalidRequest naming the field."""
    _check_openai_only(body)
    if body.echo and body.logprobs is not None:
        raise invalid("echo: with logprobs it needs the prompt's log-probabilities, which "
                      "pdserve does not serve (prompt_logprobs); drop logprobs or echo")
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


def tool_plan(body: ChatCompletionRequest, auto_parser: str | None) -> tools.ToolPlan | None:
    """How the request uses `tools` and `tool_choice` (None: no tools); raises
    InvalidRequest naming the field. `auto_parser`: the server's parser for
    `tool_choice: auto` (None: auto is off)."""
    return tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, auto_parser)


def _tool_calls(i: int, m: ChatMessage) -> list[pb.ToolCall]:
    calls = []
    for j, call in enumerate(m.tool_calls or []):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid(f"{where}: only function calls are supported: "
                          '{"id": ..., "type": "function", "function": {"name": ..., '
                          '"arguments": "..."}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"{where}.function.name: required, a non-empty string")
        args = fn.get("arguments")
        if isinstance(args, dict):
            args = json.dumps(args)
        elif args is not None and not isinstance(args, str):
            raise invalid(f"{where}.function.arguments: JSON text (a string)")
        if not isinstance(call.get("id", ""), str):
            raise invalid(f"{where}.id: a string")
        calls.append(pb.ToolCall(id=call.get("id") or "", name=fn["name"],
                                 arguments=args or ""))
    return calls


def chat_request(body: ChatCompletionRequest, request_id: str,
                 plan: tools.ToolPlan | None = None) -> pb.GenerateRequest:
    """The gRPC request for a chat body (with its tool plan, `tool_plan`); raises
    InvalidRequest naming the field."""
    _check_openai_only(body, UNSUPPORTED + CHAT_UNSUPPORTED)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs: needs `logprobs: true`")
    req = pb.GenerateRequest(request_id=request_id, model=body.model or "")
    req.chat.SetInParent()
    for i, m in enumerate(body.messages):
        req.chat.messages.add(role=m.role, content=_text_of(i, m.content),
                              tool_calls=_tool_calls(i, m), tool_call_id=m.tool_call_id or "",
                              name=m.name or "")
    for f in plan.functions if plan is not None else ():
        req.chat.tools.add(name=f.name, description=f.description or "",
                           parameters=json.dumps(f.parameters) if f.parameters else "")
    max_tokens = body.max_completion_tokens or body.max_tokens  # vLLM's precedence
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    req.sampling.CopyFrom(_sampling(body, max_tokens, logprobs))
    constraint = plan.constraint if plan is not None else None
    if constraint is not None:
        if req.sampling.HasField("structured"):
            given = "structured_outputs" if body.structured_outputs else "response_format"
            raise invalid(f"tool_choice: {body.tool_choice!r} holds the answer to a tool "
                          f"call; leave {given} unset with it")
        req.sampling.structured.CopyFrom(pb.StructuredOutput(json_schema=json.dumps(constraint)))
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


def openai_param(path: str, chat: bool, structured: str = "response_format") -> str:
    """The HTTP body's name for a gRPC field path (`sampling.top_p` -> `top_p`);
    `structured`: the body field the output constraint came in."""
    prompt = "messages" if chat else "prompt"
    if path.startswith("sampling.structured"):
        kind = path.removeprefix("sampling.structured").lstrip(".").split(".")[0]
        if structured == "structured_outputs" and kind:
            by_grpc = {v: k for k, v in STRUCTURED_KINDS.items()}
            return f"structured_outputs.{by_grpc.get(kind, kind)}"
        return structured
    if path.startswith("sampling."):
        name = path.removeprefix("sampling.")
        return "top_logprobs" if chat and name == "logprobs" else name
    if path.startswith("chat.messages"):
        return path.removeprefix("chat.")
    if path in ("text", "token_ids.ids", "input", "prompt", "chat"):
        return prompt
    return path


def openai_error(err: BaseException, chat: bool, structured: str = "response_format"
                 ) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body) for a refusal or failure. The leading field of a
    message is renamed to the HTTP body's name for it, which is also the `param`."""
    status, message = http_status(err)
    match = _FIELD.match(message)
    if match is None:
        return status, error_body(status, message)
    path = match.group(1)
    if path.startswith("sampling.structured"):  # the whole path names the gRPC field
        param = openai_param(path + match.group(2), chat, structured)
    else:
        param = openai_param(path, chat, structured) + match.group(2)
    return status, error_body(status, param + message[match.end(2):], param)
