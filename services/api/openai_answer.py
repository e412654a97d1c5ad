"""One answer in OpenAI's response format, built from the backend's deltas: the streamed
chunks, or the whole response, of `/v1/completions` and `/v1/chat/completions`, with
usage, logprobs, tool calls (`services/api/tools.py` reads them out of the text, the same
way streamed or not) and pdserve's timing anatomy as an extension field (`pdserve`)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.api.tools import CallStream, Parsed, ToolPlan
from services.messages import Delta, TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MIN_LOGPROB = -9999.0  # what OpenAI and vLLM send for -inf (JSON has no infinities)


def _lp(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB  # also maps NaN


@dataclass
class Choice:
    """One of the answer's choices (one unless the request asked for n > 1)."""

    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprob_parts: list[dict[str, Any]] = field(default_factory=list)
    text_offset: int = 0  # completions' logprobs count characters from the answer's start
    calls: CallStream | None = None  # reads tool calls out of the text, when asked for
    content: list[str] = field(default_factory=list)  # the text outside tool calls
    tokens: int = 0  # completion tokens so far


@dataclass
class Answer:
    """The answer to one request. `add` each delta in order; it returns the choice to
    stream for that delta, and `response` gives the non-streaming body at the end."""

    chat: bool
    request_id: str
    model: str
    started: float  # time.monotonic() when the request arrived
    prompt_tokens: int
    tokenizer: PreTrainedTokenizerBase
    top_logprobs: int | None = None  # logprobs asked for; None: not asked
    n: int = 1  # choices
    tools: ToolPlan | None = None  # chat: how the answer calls tools
    echo: str = ""  # completions' `echo`: the prompt's text, which the answer starts with
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    server_timings: dict[str, float] = field(default_factory=dict)
    choices: dict[int, Choice] = field(default_factory=dict)
    _token_text: dict[int, str] = field(default_factory=dict)

    def choice(self, index: int) -> Choice:
        if index not in self.choices:
            calls = self.tools.stream() if self.tools and self.tools.reads_calls else None
            self.choices[index] = Choice(calls=calls)
        return self.choices[index]

    @property
    def finish_reason(self) -> str | None:
        return self.choice(0).finish_reason

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.request_id}"

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def role_choices(self) -> list[dict[str, Any]]:
        """A chat stream's first choices: the assistant's role, no content yet."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(self.n)]

    def echo_choices(self) -> list[dict[str, Any]]:
        """A completions stream's first choices with `echo`: the prompt's text."""
        return [{"index": i, "text": self.echo, "logprobs": None, "finish_reason": None,
                 "stop_reason": None} for i in range(self.n)]

    def _tool_delta(self, c: Choice, text: str, ended: bool) -> dict[str, Any]:
        """A chat delta's content and tool calls, read out of `text`."""
        assert c.calls is not None
        parsed = c.calls.feed(text)
        if ended:
            last = c.calls.finish()
            parsed = Parsed(parsed.content + last.content, parsed.tool_calls + last.tool_calls)
        c.content.append(parsed.content)
        out: dict[str, Any] = {}
        if parsed.content:
            out["content"] = parsed.content
        if parsed.tool_calls:
            out["tool_calls"] = parsed.tool_calls
        return out

    def _finish_reason(self, c: Choice, reason: str | None) -> str | None:
        """OpenAI's (and vLLM's): an answer that ended by calling tools it chose
        (auto) or had to call (required) ends with "tool_calls"; a named call's ends
        as any answer."""
        if (reason == "stop" and c.calls is not None and c.calls.tool_calls()
                and self.tools is not None and self.tools.choice in ("auto", "required")):
            return "tool_calls"
        return reason

    def add(self, delta: Delta) -> dict[str, Any] | None:
        """The streamed choice for `delta`; None for the end of an n > 1 request, whose
        choices each ended on their own delta."""
        if delta.token_ids and not self.completion_tokens:
            self.ttft_s = time.monotonic() - self.started
        self.completion_tokens += len(delta.token_ids)
        if delta.finished:
            self.e2e_s = time.monotonic() - self.started
            self.cached_tokens = delta.num_cached_tokens
            self.server_timings = dataclasses.asdict(delta.timings)
            if self.n > 1:
                return None
        c = self.choice(delta.index)
        c.tokens += len(delta.token_ids)
        c.texts.append(delta.text)
        logprobs = None
        if self.top_logprobs is not None and delta.logprobs:
            logprobs = self._logprobs(c, delta.logprobs)
            c.logprob_parts.append(logprobs)
        if delta.finished:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
        elif delta.choice_finish_reason is not None:
            c.finish_reason, c.stop_reason = delta.choice_finish_reason, delta.choice_stop_reason
        choice: dict[str, Any] = {"index": delta.index}
        if self.chat and c.calls is not None:
            choice["delta"] = self._tool_delta(c, delta.text, c.finish_reason is not None)
            c.finish_reason = self._finish_reason(c, c.finish_reason)
        elif self.chat:
            choice["delta"] = {"content": delta.text} if delta.text else {}
        else:
            choice["text"] = delta.text
        choice.update(logprobs=logprobs, finish_reason=c.finish_reason,
                      stop_reason=c.stop_reason)
        return choice

    async def collect(self, deltas: AsyncIterator[Delta]) -> None:
        async for delta in deltas:
            self.add(delta)

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def running_usage(self, index: int | None) -> dict[str, int]:
        """The usage so far, for a streamed chunk (vLLM's continuous usage stats): the
        completion tokens of choice `index` (as vLLM counts them), None: of all."""
        done = self.completion_tokens if index is None else self.choice(index).tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def timings(self) -> dict[str, float]:
        """Server-side anatomy in seconds, named as in the gRPC API's Timings message."""
        t = {**self.server_timings, "ttft_s": self.ttft_s, "e2e_s": self.e2e_s}
        return {k: int(v) if k.endswith("_bytes") else round(v, 6)
                for k, v in t.items() if math.isfinite(v)}

    def extension(self) -> dict[str, Any]:
        return {"timings": self.timings()}

    def response(self) -> dict[str, Any]:
        """The non-streaming body."""
        choices = []
        for i in range(self.n):
            c = self.choice(i)
            text = "".join(c.texts)
            choice: dict[str, Any] = {"index": i}
            if self.chat and c.calls is not None:
                content, calls = "".join(c.content), c.calls.tool_calls()
                choice["message"] = {"role": "assistant",
                                     "content": None if calls and not content.strip()
                                     else content}
                if calls:
                    choice["message"]["tool_calls"] = calls
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = self.echo + text
            choice.update(logprobs=_merged_logprobs(c), finish_reason=c.finish_reason,
                          stop_reason=c.stop_reason)
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(), "pdserve": self.extension()}

    # -- logprobs -------------------------------------------------------------------------
    def _text(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = str(self.tokenizer.decode([token_id]))
        return self._token_text[token_id]

    def _logprobs(self, c: Choice, items: list[TokenLogprob]) -> dict[str, Any]:
        if self.chat:  # OpenAI: top_logprobs lists exactly the k most likely tokens
            k = self.top_logprobs or 0
            return {"content": [
                {**self._entry(lp.token_id, lp.logprob),
                 "top_logprobs": [self._entry(t, v) for t, v in lp.top[:k]]}
                for lp in items]}
        # Completions (as vLLM): the chosen token with the k most likely, offsets in text.
        part: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                                      "top_logprobs": []}
        for lp in items:
            token = self._text(lp.token_id)
            part["text_offset"].append(c.text_offset)
            part["token_logprobs"].append(_lp(lp.logprob))
            part["tokens"].append(token)
            part["top_logprobs"].append(
                {self._text(lp.token_id): _lp(lp.logprob)}
                | {self._text(t): _lp(v) for t, v in lp.top})
            c.text_offset += len(token)
        return part

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._text(token_id)
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode())}



def _merged_logprobs(c: Choice) -> dict[str, Any] | None:
    if not c.logprob_parts:
        return None
    merged: dict[str, list[Any]] = {}
    for part in c.logprob_parts:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    return merged
