"""Tool calling for the OpenAI chat API: the request's `tools` and `tool_choice`, the
output constraint that enforces a call, and the parsers that find calls in an answer.

How each `tool_choice` is served (as vLLM's OpenAI server does):

- `none`: the tools are shown to the model (the chat template renders them); the answer
  is text.
- `required`: the answer is held by a JSON schema to an array of calls, `[{"name": ...,
  "parameters": {...}}, ...]`, each naming a tool and carrying arguments its schema
  validates (`required_schema`).
- a named function (`{"type": "function", "function": {"name": ...}}`): the answer is
  held to that function's parameter schema and is the call's arguments.
- `auto` (the default when `tools` are given): the model decides; a parser for the
  model family's format (`PARSERS`, `--tool-call-parser`) finds the calls in its text.

Every form is read by a `CallStream`: fed the answer's text as it arrives, it gives the
content and the tool-call deltas to stream (OpenAI's: the call's id, type and name
first, then its arguments in fragments). A whole response is the same stream fed at
once, so a streamed answer reassembles to exactly the response's calls. The arguments
are the model's own JSON text, never re-serialized.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.api.validation import invalid

ARGUMENT_KEYS = ("arguments", "parameters")  # what a call's arguments are named in its JSON


def call_id() -> str:
    """An id for a call, in OpenAI's form (`call_` and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the request ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Function:
    """One tool of the request: a function the model may call."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def as_dict(self) -> dict[str, Any]:
        """The tool as OpenAI's body has it, which is what chat templates read."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request uses its tools: `choice` is none, auto, required or named (then
    `name` is the function's)."""

    functions: tuple[Function, ...]
    choice: str
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only
    parser: str | None = None  # auto: the parser that reads the answer

    @property
    def constraint(self) -> dict[str, Any] | None:
        """The JSON schema that enforces the call (required, named), else None."""
        if self.choice == "required":
            return required_schema(self.functions, self.parallel)
        if self.choice == "named":
            return arguments_schema(next(f for f in self.functions if f.name == self.name))
        return None

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    def stream(self) -> CallStream:
        """A reader for one answer (one choice)."""
        if self.choice == "required":
            reader: CallStream = RequiredCalls()
        elif self.choice == "named":
            reader = NamedCall(self.name or "")
        elif self.choice == "auto":
            reader = PARSERS[self.parser or ""]()
        else:
            reader = CallStream()
        reader.parallel = self.parallel
        return reader


def check_tools(raw: Any) -> tuple[Function, ...]:
    """The request's `tools`, checked; raises InvalidRequest naming the field."""
    if not isinstance(raw, list) or not raw:
        raise invalid("tools: a non-empty list of tools, each "
                      '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
    functions: list[Function] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"{where}: a tool is an object")
        if tool.get("type", "function") != "function":
            raise invalid(f"{where}.type: {tool.get('type')!r} is not supported; only "
                          '"function" tools are')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"{where}.function: required, an object with the function's name")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.function.name: required, a non-empty string")
        if any(f.name == name for f in functions):
            raise invalid(f"{where}.function.name: {name!r} names two tools; names are "
                          "unique")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{where}.function.description: a string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"{where}.function.parameters: a JSON schema (an object)")
        if params is not None and "$defs" in params and not isinstance(params["$defs"], dict):
            raise invalid(f"{where}.function.parameters.$defs: an object of schemas")
        functions.append(Function(name, description, params))
    return tuple(functions)


def plan(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None,
         auto_parser: str | None) -> ToolPlan | None:
    """The tool plan of a chat request (None: no tools); raises InvalidRequest naming
    the field. `auto_parser`: the server's parser for `auto` (None: auto is off)."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise invalid("tool_choice: needs `tools` (the functions it may call)")
        return None
    functions = check_tools(tools)
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto"  # OpenAI's default when tools are given
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid('tool_choice: a named choice is {"type": "function", "function": '
                          '{"name": ...}}')
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid("tool_choice.function.name: required, a non-empty string")
        if not any(f.name == name for f in functions):
            raise invalid(f"tool_choice.function.name: {name!r} is not one of the tools "
                          f"({', '.join(f.name for f in functions)})")
        return ToolPlan(functions, "named", name, parallel)
    if tool_choice in ("none", "required"):
        return ToolPlan(functions, tool_choice, parallel=parallel)
    if tool_choice == "auto":
        if auto_parser is None:
            raise invalid('tool_choice: "auto" tool choice requires --enable-auto-tool-choice '
                          "and --tool-call-parser to be set on the server; ask for "
                          '"required" or a named function instead')
        return ToolPlan(functions, "auto", parallel=parallel, parser=auto_parser)
    raise invalid(f"tool_choice: {tool_choice!r} is not supported; use none, auto, required "
                  'or {"type": "function", "function": {"name": ...}}')


# -- the constraints --------------------------------------------------------------------
def _params(f: Function) -> dict[str, Any]:
    # A function without parameters still takes a JSON object (empty).
    return f.parameters or {"type": "object", "properties": {}}


def arguments_schema(f: Function) -> dict[str, Any]:
    """A named function's constraint: its arguments, which are the whole answer."""
    return _params(f)


def required_schema(functions: Sequence[Function], parallel: bool = True) -> dict[str, Any]:
    """`tool_choice: required`: an array of one or more calls (one when not `parallel`),
    each naming a tool with arguments its schema validates. Each tool's `$defs` move to
    the top, where their `#/$defs/...` references resolve."""
    defs: dict[str, Any] = {}
    calls = []
    for i, f in enumerate(functions):
        params = copy.deepcopy(_params(f))
        for name, definition in params.pop("$defs", {}).items():
            if defs.get(name, definition) != definition:
                raise invalid(f"tools[{i}].function.parameters.$defs.{name}: another tool "
                              "defines it differently; give the definitions distinct names")
            defs[name] = definition
        calls.append({"properties": {"name": {"type": "string", "enum": [f.name]},
                                     "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# -- reading JSON as it arrives ---------------------------------------------------------
class Malformed(ValueError):
    """The text cannot be the JSON expected there."""


_WS = " \t\r\n"


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """The index after the JSON string starting at s[i] (a quote); None: not complete."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """The index after the JSON value starting at s[i]; None: not complete (a number
    is complete only once something follows it)."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                end = _string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    if j == i:
        raise Malformed(f"no JSON value at {s[i:i + 20]!r}")
    return j if j < len(s) else None


@dataclass
class CallScan:
    """What a prefix of one call's JSON object (`{"name": ..., "arguments": {...}}`) holds
    so far: the name once complete, where the arguments' text starts and ends, where the
    object ends. Indices are into the scanned text."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None


def scan_call(s: str, i: int = 0) -> CallScan:
    """Read the call object starting at s[i] (after optional whitespace) as far as `s`
    goes; raises Malformed when it cannot be one."""
    out = CallScan()
    j = _skip_ws(s, i)
    if j >= len(s):
        return out
    if s[j] != "{":
        raise Malformed(f"a call is a JSON object, not {s[j:j + 20]!r}")
    j += 1
    while True:
        j = _skip_ws(s, j)
        if j >= len(s):
            return out
        if s[j] == "}":
            out.end = j + 1
            return out
        if s[j] == ",":
            j += 1
            continue
        if s[j] != '"':
            raise Malformed(f"expected a key at {s[j:j + 20]!r}")
        key_end = _string_end(s, j)
        if key_end is None:
            return out
        key = json.loads(s[j:key_end])
        j = _skip_ws(s, key_end)
        if j >= len(s):
            return out
        if s[j] != ":":
            raise Malformed(f"expected ':' after the key {key!r}")
        j = _skip_ws(s, j + 1)
        if j >= len(s):
            return out
        if key in ARGUMENT_KEYS and out.args_start is None:
            out.args_start = j
        end = _value_end(s, j)
        if end is None:
            return out
        if key == "name":
            name = json.loads(s[j:end])
            if not isinstance(name, str):
                raise Malformed("a call's name is a string")
            out.name = name
        elif key in ARGUMENT_KEYS and out.args_start == j:
            out.args_end = end
        j = end


# -- reading calls out of an answer ------------------------------------------------------
@dataclass
class _Call:
    index: int
    id: str = field(default_factory=call_id)
    name: str = ""
    arguments: str = ""
    started: bool = False  # its id, type and name went out


@dataclass
class Parsed:
    """What a piece of the answer adds: content, and tool-call deltas in OpenAI's form."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class CallStream:
    """Reads one answer as it arrives (`feed`, then `finish`): plain text, no calls.
    Subclasses find calls; each keeps the calls it found in `calls`."""

    parallel: bool = True

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self._out = Parsed()

    def feed(self, text: str) -> Parsed:
        self._read(text)
        return self._take()

    def finish(self) -> Parsed:
        self._end()
        for call in self.calls:
            if call.started and not call.arguments:
                self._args(call, "{}")  # a call without arguments takes none: {}
        return self._take()

    # -- for subclasses
    def _read(self, text: str) -> None:
        self._out.content += text

    def _end(self) -> None:
        pass

    def _start(self, call: _Call) -> None:
        call.started = True
        if self._kept(call):
            self._out.tool_calls.append({"index": call.index, "id": call.id, "type": "function",
                                         "function": {"name": call.name, "arguments": ""}})

    def _args(self, call: _Call, fragment: str) -> None:
        if not fragment:
            return
        call.arguments += fragment
        if self._kept(call):
            self._out.tool_calls.append({"index": call.index,
                                         "function": {"arguments": fragment}})

    def _kept(self, call: _Call) -> bool:
        return self.parallel or call.index == 0

    def _take(self) -> Parsed:
        out, self._out = self._out, Parsed()
        out.tool_calls = _merged(out.tool_calls)
        return out

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls found, as a whole response's `message.tool_calls`."""
        return [{"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls if c.started and self._kept(c)]


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One delta per call in a chunk: its header and its argument fragments together."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append({**d, "function": dict(d["function"])})
    return out


class _CallReader:
    """Streams one call object's JSON as it grows: the call starts once its name is
    complete, then its arguments' text goes out as it arrives."""

    def __init__(self, owner: CallStream, index: int) -> None:
        self.owner, self.call, self.sent = owner, _Call(index), 0

    def update(self, s: str, start: int = 0) -> CallScan:
        scan = scan_call(s, start)
        call = self.call
        if scan.name is not None and not call.started:
            call.name = scan.name
            self.owner.calls.append(call)
            self.owner._start(call)
        if call.started and scan.args_start is not None:
            end = scan.args_end if scan.args_end is not None else len(s)
            begin = scan.args_start + self.sent
            if end > begin:
                self.owner._args(call, s[begin:end])
                self.sent = end - scan.args_start
        return scan


class NamedCall(CallStream):
    """`tool_choice` naming a function: the whole answer is the call's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.call = _Call(0, name=name)

    def _read(self, text: str) -> None:
        if not self.call.started:
            self.calls.append(self.call)
            self._start(self.call)
        self._args(self.call, text)

    def _end(self) -> None:
        self._read("")


class RequiredCalls(CallStream):
    """`tool_choice: required`: the answer is a JSON array of `{"name", "parameters"}`."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.next = 0  # where the array's next item (or its end) is read from
        self.opened = self.done = False
        self.reader: _CallReader | None = None
        self.pos = 0  # where the current call's object starts

    def _read(self, text: str) -> None:
        self.text += text
        try:
            self._scan()
        except Malformed:
            self.done = True  # the constraint makes this unreachable; stop reading

    def _scan(self) -> None:
        s = self.text
        while not self.done:
            if self.reader is None:
                j = _skip_ws(s, self.next)
                if j >= len(s):
                    return
                if not self.opened:
                    if s[j] != "[":
                        raise Malformed("the calls are a JSON array")
                    self.opened, self.next = True, j + 1
                    continue
                if s[j] == "]":
                    self.done = True
                    return
                if s[j] == ",":
                    self.next = j + 1
                    continue
                self.reader, self.pos = _CallReader(self, len(self.calls)), j
            scan = self.reader.update(s, self.pos)
            if scan.end is None:
                return
            self.next, self.reader = scan.end, None


TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


class HermesCalls(CallStream):
    """Hermes' format (Qwen 2.5/3, Hermes 2/3 and other models trained on it; vLLM's
    `hermes` parser): each call is `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>` in the answer's text; the text around the calls is content. A block
    that is not a call object stays content; a call the answer leaves unclosed ends
    with the answer."""

    start, end = TOOL_CALL_START, TOOL_CALL_END

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""  # text not yet given out: a possible start of a tag, or a block
        self.reader: _CallReader | None = None  # inside a block
        self.malformed = False  # the current block is not a call: it stays content

    def _read(self, text: str) -> None:
        self.pending += text
        while self.pending:
            if self.reader is None:
                if not self._text():
                    return
            elif not self._block():
                return

    def _text(self) -> bool:
        """Content up to the next block; True when a block starts."""
        at = self.pending.find(self.start)
        if at < 0:
            keep = _partial_tag(self.pending, self.start)
            self._out.content += self.pending[:len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        self._out.content += self.pending[:at]
        self.pending = self.pending[at + len(self.start):]
        self.reader, self.malformed = _CallReader(self, len(self.calls)), False
        return True

    def _block(self) -> bool:
        """Read the open block; True when it closed (the rest is text again)."""
        assert self.reader is not None
        scan_end: int | None = None
        if not self.malformed:
            try:
                scan_end = self.reader.update(self.pending).end
            except Malformed:
                self.malformed = not self.reader.call.started
        close = self.pending.find(self.end, scan_end or 0)
        while close >= 0 and scan_end is None and _in_string(self.pending, close):
            close = self.pending.find(self.end, close + 1)  # a closing tag inside a string
        if close < 0:
            return False
        if self.malformed:
            self._out.content += self.start + self.pending[:close + len(self.end)]
        self.pending = self.pending[close + len(self.end):]
        self.reader = None
        return True

    def _end(self) -> None:
        if self.reader is not None and not self.reader.call.started:
            self._out.content += self.start + self.pending  # never became a call
        elif self.reader is None:
            self._out.content += self.pending
        self.pending, self.reader = "", None


def _in_string(text: str, at: int) -> bool:
    """Whether text[at] lies inside a JSON string literal of `text`."""
    inside, j = False, 0
    while j < at:
        if inside and text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            inside = not inside
        j += 1
    return inside


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# Parsers by the name `--tool-call-parser` takes (vLLM's names).
PARSERS: dict[str, Callable[[], CallStream]] = {"hermes": HermesCalls}


def parse(reader: CallStream, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer read at once: (content, `message.tool_calls`). Content is None when
    the answer is calls only."""
    content = reader.feed(text).content + reader.finish().content
    calls = reader.tool_calls()
    return (None if calls and not content.strip() else content), calls
