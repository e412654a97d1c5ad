"""Tool calling without an engine: the request's tools and tool_choice, the constraints
that enforce a call, the parsers that read calls out of an answer (streamed in every
possible split, and whole), OpenAI's response and chunk shapes, and the chat template
receiving tools and calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pdserve.v1 import generate_pb2 as pb
from services.api import tools
from services.api.openai_answer import Answer
from services.api.openai_schema import ChatCompletionRequest, chat_request, tool_plan
from services.api.prompts import render
from services.api.validation import PromptInput
from services.errors import InvalidRequest, PdserveError
from services.limits import Limits, check_sampling
from services.messages import Delta

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _plan(choice: Any = None, parser: str | None = "hermes", **extra: Any) -> tools.ToolPlan:
    p = tools.plan(extra.get("tools", TOOLS), choice, extra.get("parallel"), parser)
    assert p is not None
    return p


# -- tools and tool_choice ------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "choice", "needle"), [
    ([], None, "tools: a non-empty list"),
    ("x", None, "tools: a non-empty list"),
    ([{"type": "retrieval"}], None, "tools[0].type: 'retrieval' is not supported"),
    ([{"type": "function"}], None, "tools[0].function: required"),
    ([{"type": "function", "function": {"name": ""}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name: 'get_weather' names two tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None,
     "tools[0].function.parameters: a JSON schema"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}},
     "tool_choice.function.name: 'nope' is not one of the tools (get_weather, get_time)"),
    (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name: required"),
    (TOOLS, {"type": "function"}, "tool_choice: a named choice"),
    (TOOLS, "sometimes", "tool_choice: 'sometimes' is not supported"),
    (None, "required", "tool_choice: needs `tools`"),
])
def test_bad_tools_and_choices_name_the_field(raw: Any, choice: Any, needle: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        tools.plan(raw, choice, None, "hermes")
    assert str(e.value).startswith(needle), str(e.value)


def test_the_settings_know_every_parser() -> None:
    from services.server.settings import TOOL_CALL_PARSERS, ServerConfig

    assert set(TOOL_CALL_PARSERS) == set(tools.PARSERS)
    assert ServerConfig(enable_auto_tool_choice=True,
                        tool_call_parser="hermes").auto_tool_parser == "hermes"
    assert ServerConfig(tool_call_parser="hermes").auto_tool_parser is None
    for bad in ({"tool_call_parser": "nope"}, {"enable_auto_tool_choice": True}):
        with pytest.raises(ValueError, match=r"tool_call_parser|enable_auto_tool_choice"):
            ServerConfig(**bad)  # type: ignore[arg-type]


def test_auto_needs_the_server_parser_as_vllm_does() -> None:
    for choice in (None, "auto"):  # tools without tool_choice mean auto
        with pytest.raises(InvalidRequest, match="requires --enable-auto-tool-choice"):
            tools.plan(TOOLS, choice, None, None)
        assert _plan(choice).choice == "auto"
    assert _plan("none", parser=None).choice == "none"  # none and required need no parser
    assert _plan("required", parser=None).choice == "required"
    assert tools.plan(None, None, None, None) is None
    assert tools.plan(None, "none", None, None) is None


def test_required_schema_takes_calls_of_the_tools_only() -> None:
    schema = _plan("required").constraint
    assert schema is not None
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}},
          {"name": "get_time", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"town": "Paris"}}],
                [{"name": "launch", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = _plan("required", parallel=False).constraint
    assert one is not None and one["maxItems"] == 1


def test_required_schema_lifts_defs_where_references_resolve() -> None:
    with_defs = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}},
                            "required": ["x"]}}}}}
    schema = _plan("required", tools=[with_defs]).constraint
    assert schema is not None and "point" in schema["$defs"]
    jsonschema.validate([{"name": "move", "parameters": {"to": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "move", "parameters": {"to": {"x": "a"}}}], schema)
    assert "$defs" in with_defs["function"]["parameters"]  # the request is not changed
    clash = json.loads(json.dumps(with_defs))
    clash["function"]["name"] = "jump"
    clash["function"]["parameters"]["$defs"]["point"] = {"type": "string"}
    with pytest.raises(InvalidRequest, match=r"tools\[1\].function.parameters.\$defs.point"):
        _plan("required", tools=[with_defs, clash]).constraint  # noqa: B018


def test_named_schema_is_the_function_arguments() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _plan(named).constraint == WEATHER["function"]["parameters"]  # type: ignore[index]
    no_params = {"type": "function", "function": {"name": "get_time"}}
    assert _plan(no_params).constraint == {"type": "object", "properties": {}}
    assert _plan("none").constraint is None and _plan("auto").constraint is None


# -- reading calls ----------------------------------------------------------------------------
def streamed(reader: tools.CallStream, text: str, size: int
             ) -> tuple[str, list[dict[str, Any]]]:
    """The text fed `size` characters at a time: (content, calls reassembled from the
    deltas as an OpenAI client does)."""
    parts = [reader.feed(text[i:i + size]) for i in range(0, len(text), size)]
    parts.append(reader.finish())
    calls: dict[int, dict[str, Any]] = {}
    for part in parts:
        for d in part.tool_calls:
            if "id" in d:
                assert d["index"] not in calls, "a call started twice"
                assert d["type"] == "function" and d["function"]["name"]
                calls[d["index"]] = {"id": d["id"], "type": "function",
                                     "function": {"name": d["function"]["name"],
                                                  "arguments": ""}}
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    assert list(calls) == list(range(len(calls)))
    return "".join(p.content for p in parts), [calls[i] for i in sorted(calls)]


def without_ids(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    for c in calls:
        assert c["id"].startswith("call_") and len(c["id"]) == 29
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


HERMES_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    # (model text, content, calls)
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Paris"}')]),
    ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris, ", '
     '"unit": "c"}}</tool_call>',
     "Let me check. ", [("get_weather", '{"city": "Paris, ", "unit": "c"}')]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>',
     None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    # a string holding braces, quotes and the closing tag is still the arguments'
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "a}\\"</tool_call>"}}'
     "</tool_call>", None, [("get_weather", '{"city": "a}\\"</tool_call>"}')]),
    ('<tool_call>{"name": "get_time"}</tool_call> done', " done", [("get_time", "{}")]),
    # "parameters" is read as the arguments too (some models write it)
    ('<tool_call>{"name": "get_time", "parameters": {"tz": "UTC"}}</tool_call>', None,
     [("get_time", '{"tz": "UTC"}')]),
    # unclosed at the end of the answer: the call ends with it
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}', None,
     [("get_weather", '{"city": "Rome"}')]),
    # not a call: the block stays content
    ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ("<tool_call>[1, 2]", "<tool_call>[1, 2]", []),
    ("1 < 2 and <tool_ca", "1 < 2 and <tool_ca", []),  # a tag's start that never completes
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_whole(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = tools.parse(tools.HermesCalls(), text)
    assert got_content == content
    assert without_ids(got_calls) == calls
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_streamed_in_every_split_is_the_whole(
        text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    for size in (1, 2, 3, 5, 7, 11, len(text)):
        got_content, got_calls = streamed(tools.HermesCalls(), text, size)
        assert got_content == (content or "") or (content is None and not got_content.strip())
        assert without_ids(got_calls) == calls, size


def test_hermes_streams_the_name_before_the_arguments_end() -> None:
    reader = tools.HermesCalls()
    assert reader.feed("Sure <tool").content == "Sure "  # the tag's start is held back
    part = reader.feed('_call>{"name": "get_weather", "arguments": {"ci')
    assert part.content == ""
    assert part.tool_calls == [{"index": 0, "id": reader.calls[0].id, "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"ci'}}]
    assert reader.feed('ty": "Paris"}}').tool_calls == [
        {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]
    assert reader.feed("</tool_call>").tool_calls == []
    assert reader.finish().tool_calls == []


def test_parallel_false_keeps_the_first_call() -> None:
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>')
    reader = _plan("auto", parallel=False).stream()
    assert without_ids(streamed(reader, text, 4)[1]) == [("get_time", "{}")]
    assert without_ids(reader.tool_calls()) == [("get_time", "{}")]


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, '
            '{"name": "get_time", "parameters": {}}]')


def test_required_calls_whole_and_streamed() -> None:
    expected = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}")]
    content, calls = tools.parse(tools.RequiredCalls(), REQUIRED)
    assert content is None and without_ids(calls) == expected
    for size in (1, 3, 8, len(REQUIRED)):
        assert without_ids(streamed(tools.RequiredCalls(), REQUIRED, size)[1]) == expected


def test_named_call_is_the_whole_answer() -> None:
    text = '{"city": "Paris"}'
    content, calls = tools.parse(tools.NamedCall("get_weather"), text)
    assert content is None and without_ids(calls) == [("get_weather", text)]
    for size in (1, 4):
        assert without_ids(streamed(tools.NamedCall("get_weather"), text, size)[1]) == [
            ("get_weather", text)]
    # an answer cut before its first token still is the call, with empty arguments
    assert without_ids(tools.parse(tools.NamedCall("get_time"), "")[1]) == [("get_time", "{}")]


def test_scan_call_refuses_what_cannot_be_a_call() -> None:
    for text in ("[", '{"name" 1}', '{1: 2}', '{"name": 3}'):
        with pytest.raises(tools.Malformed):
            tools.scan_call(text)
    assert tools.scan_call('  {"name": "f", "argu').name == "f"


# -- OpenAI's shapes ----------------------------------------------------------------------------
class FakeTokenizer:
    """Fake: Answer needs a tokenizer only for logprobs."""

    def decode(self, ids: list[int]) -> str:
        return ""


def answer(plan: tools.ToolPlan | None) -> Answer:
    return Answer(chat=True, request_id="r", model="m", started=0.0, prompt_tokens=3,
                  tokenizer=FakeTokenizer(), tools=plan)  # type: ignore[arg-type]


def deltas(text: str, finish: str = "stop", size: int = 3) -> list[Delta]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    return [Delta([1], p) for p in pieces[:-1]] + [
        Delta([1], pieces[-1], finished=True, finish_reason=finish)]


def test_response_and_stream_of_a_required_call() -> None:
    a = answer(_plan("required"))
    chunks = [a.add(d) for d in deltas(REQUIRED)]
    response = a.response()["choices"][0]
    assert response["finish_reason"] == "tool_calls"
    message = response["message"]
    assert message["content"] is None
    assert without_ids(message["tool_calls"]) == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}")]
    assert chunks[-1] is not None and chunks[-1]["finish_reason"] == "tool_calls"
    assert all(c is not None and "content" not in c["delta"] for c in chunks)
    streamed_ids = [tc["id"] for c in chunks if c is not None
                    for tc in c["delta"].get("tool_calls", []) if "id" in tc]
    assert streamed_ids == [tc["id"] for tc in message["tool_calls"]]


def test_named_call_ends_as_any_answer_and_cut_answers_keep_length() -> None:
    a = answer(_plan({"type": "function", "function": {"name": "get_weather"}}))
    for d in deltas('{"city": "Paris"}'):
        a.add(d)
    choice = a.response()["choices"][0]
    assert choice["finish_reason"] == "stop"  # OpenAI's and vLLM's for a named function
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    cut = answer(_plan("required"))
    for d in deltas('[{"name": "get_weather", "param', finish="length"):
        cut.add(d)
    assert cut.response()["choices"][0]["finish_reason"] == "length"


def test_auto_without_calls_is_content_and_none_reads_nothing() -> None:
    a = answer(_plan("auto"))
    for d in deltas("Paris is sunny."):
        a.add(d)
    choice = a.response()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Paris is sunny."}
    assert choice["finish_reason"] == "stop"
    text = '<tool_call>{"name": "get_time"}</tool_call>'
    none = answer(_plan("none"))
    for d in deltas(text):
        none.add(d)
    assert none.response()["choices"][0]["message"] == {"role": "assistant", "content": text}


# -- the request -------------------------------------------------------------------------------
def test_chat_request_carries_tools_calls_and_the_constraint() -> None:
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = ChatCompletionRequest(messages=messages, tools=TOOLS, tool_choice="required")
    plan = tool_plan(body, None)
    req = chat_request(body, "r", plan)
    assert [t.name for t in req.chat.tools] == ["get_weather", "get_time"]
    assert json.loads(req.chat.tools[0].parameters) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert req.chat.tools[1].parameters == ""
    call = req.chat.messages[1].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert req.chat.messages[2].tool_call_id == "call_1"
    assert json.loads(req.sampling.structured.json_schema) == plan.constraint  # type: ignore[union-attr]
    assert body.structured_param == "tools"


def test_chat_request_refuses_a_tool_constraint_beside_another() -> None:
    body = ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice="required",
                                 response_format={"type": "json_object"})
    with pytest.raises(InvalidRequest, match="tool_choice: 'required' holds the answer"):
        chat_request(body, "r", tool_plan(body, None))
    bad_call = ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"arguments": "{}"}}]}])
    with pytest.raises(InvalidRequest, match=r"messages\[0\].tool_calls\[0\].function.name"):
        chat_request(bad_call, "r")


HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments.city }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}<assistant>")


def test_the_chat_template_gets_tools_and_calls(model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    tokenizer.chat_template = HERMES_TEMPLATE  # one that renders tools, as Qwen's does
    body = ChatCompletionRequest(messages=[*USER, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=TOOLS,
        tool_choice="none")
    req = chat_request(body, "r", tool_plan(body, None))
    prompt = PromptInput(chat=tuple((m.role, m.content) for m in req.chat.messages))
    text = tokenizer.decode(render(prompt, tokenizer, req.chat))
    # (Transformers renders templates with trim_blocks: no newline after a block tag)
    assert text == ("<tools>get_weather;get_time;</tools>\n<user>Weather in Paris?"
                    "<assistant><tool_call>get_weatherParis</tool_call><tool>sunny[call_1]"
                    "<assistant>")
    req.chat.messages[1].tool_calls[0].arguments = "not json"
    with pytest.raises(PdserveError, match=r"chat.messages\[1\].tool_calls\[0\].arguments"):
        render(prompt, tokenizer, req.chat)


# -- logit_bias and include_stop_str_in_output (the sampling fields) -----------------------
def test_logit_bias_is_checked_against_the_vocabulary() -> None:
    limits = Limits("m", 64, 100)
    s = check_sampling(pb.SamplingParams(logit_bias={5: 100.0, 1: -2.5},
                                         include_stop_str_in_output=True), limits)
    assert s.logit_bias == ((1, -2.5), (5, 100.0))
    assert s.vllm_kwargs()["logit_bias"] == {1: -2.5, 5: 100.0}
    assert s.vllm_kwargs()["include_stop_str_in_output"] is True
    assert "logit_bias" not in check_sampling(pb.SamplingParams(), limits).vllm_kwargs()
    with pytest.raises(InvalidRequest, match=r"sampling\.logit_bias: token 100 is outside"):
        check_sampling(pb.SamplingParams(logit_bias={100: 1.0}), limits)
    with pytest.raises(InvalidRequest, match="must be in"):
        check_sampling(pb.SamplingParams(logit_bias={1: 101.0}), limits)
