"""Tool calling over the OpenAI API of real stacks (one colocated engine, and a prefill/
decode pair), driven by the real `openai` client: `required` and a named function give
calls whose arguments obey the tools' schemas, identical greedy calls colocated and
disaggregated, a whole round trip (call -> tool message -> answer), streamed deltas that
reassemble to the same calls, and `auto` reading Hermes-format calls out of the text.

SmolLM2-135M does not write `<tool_call>` blocks of its own accord, so `auto` is driven
end to end by an answer held by a regex to a Hermes block (structured outputs, which `auto`
leaves free): the parser then reads a real engine's streamed text, split where the
tokenizer splits it. The parser on free-form model text is tested in
tests/unit/test_tool_calls.py.

The same stacks also serve the sampling fields carried to both engines (`logit_bias`,
`include_stop_str_in_output`) and completions' `echo`: identical colocated and
disaggregated."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from services.api.client import PdserveClient
from tests.helpers.servers import DisaggStack, ServerProcess

pytestmark = pytest.mark.engine

AUTO = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
WEATHER_PARAMS = {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 20},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "The current weather in a city.",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time",
                                      "description": "The local time in a time zone.",
                                      "parameters": {"type": "object",
                                                     "properties": {"zone": {"type": "string",
                                                                             "maxLength": 20}},
                                                     "required": ["zone"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# auto: a Hermes block the answer is held to (the model would not write one on its own)
HERMES_REGEX = (r'Checking\. <tool_call>\{"name": "get_weather", "arguments": '
                r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}</tool_call>')
MAX_TOKENS = 64


@pytest.fixture(scope="module")
async def tool_colocated(model_path: Path, session_dir: Path) -> AsyncIterator[ServerProcess]:
    server = ServerProcess(["--mode", "colocated", "--kv-cache-gib", "1", *AUTO],
                           session_dir / "tools-colocated.log")
    async with server.running():
        yield server


@pytest.fixture(scope="module")
async def tool_disagg(model_path: Path, session_dir: Path) -> AsyncIterator[DisaggStack]:
    stack = DisaggStack.create(session_dir / "tools-disagg.log", "grpc", "--no-pin-scheduler",
                               *AUTO)
    async with stack.server.running(timeout=600):
        yield stack


@pytest.fixture(scope="module")
def servers(tool_colocated: ServerProcess, tool_disagg: DisaggStack) -> dict[str, ServerProcess]:
    return {"colocated": tool_colocated, "disaggregated": tool_disagg.server}


def client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def calls_of(message: Any) -> list[tuple[str, str]]:
    """(name, arguments) of each call, checking the ids' form."""
    out = []
    for call in message.tool_calls or []:
        assert call.id.startswith("call_") and call.type == "function"
        out.append((call.function.name, call.function.arguments))
    return out


def obey(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def chat(server: ServerProcess, **kw: Any) -> Any:
    async with client(server) as c:
        kw.setdefault("messages", ASK)
        kw.setdefault("max_tokens", MAX_TOKENS)
        return await c.chat.completions.create(model="", temperature=0, **kw)


async def chat_stream(server: ServerProcess, **kw: Any) -> tuple[str, list[tuple[str, str]],
                                                                   list[str], str | None]:
    """A streamed answer reassembled as an OpenAI client does: (content, calls, ids,
    finish_reason)."""
    kw.setdefault("max_tokens", MAX_TOKENS)
    async with client(server) as c:
        stream = await c.chat.completions.create(model="", messages=ASK, temperature=0,
                                                 stream=True, **kw)
        content, calls, finish = "", {}, None
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:
                    if d.id is not None:  # a call starts: id, type and name come first
                        assert d.index not in calls and d.type == "function"
                        assert d.function is not None and d.function.name
                        calls[d.index] = [d.id, d.function.name, ""]
                    assert d.function is not None
                    calls[d.index][2] += d.function.arguments or ""
                finish = choice.finish_reason or finish
    ordered = [calls[i] for i in sorted(calls)]
    return (content, [(name, args) for _, name, args in ordered], [i for i, _, _ in ordered],
            finish)


async def test_required_and_named_calls_obey_and_match_colocated(
        servers: dict[str, ServerProcess]) -> None:
    got: dict[str, list[Any]] = {}
    for mode, server in servers.items():
        required = (await chat(server, tools=TOOLS, tool_choice="required")).choices[0]
        assert required.finish_reason == "tool_calls", mode
        assert required.message.content is None
        obey(calls_of(required.message))
        named = (await chat(server, tools=TOOLS, tool_choice=NAMED)).choices[0]
        assert named.finish_reason == "stop", mode  # OpenAI's, for a named function
        assert [n for n, _ in calls_of(named.message)] == ["get_weather"]
        obey(calls_of(named.message))
        got[mode] = [calls_of(required.message), calls_of(named.message)]
    assert got["disaggregated"] == got["colocated"]


async def test_streamed_calls_reassemble_to_the_whole_response(
        servers: dict[str, ServerProcess]) -> None:
    for mode, server in servers.items():
        for choice, finish in (("required", "tool_calls"), (NAMED, "stop")):
            whole = (await chat(server, tools=TOOLS, tool_choice=choice)).choices[0]
            content, calls, ids, streamed_finish = await chat_stream(
                server, tools=TOOLS, tool_choice=choice)
            assert calls == calls_of(whole.message), (mode, choice)
            assert content == "" and streamed_finish == finish
            assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)


async def test_round_trip_call_tool_message_answer(servers: dict[str, ServerProcess]) -> None:
    answers = {}
    for mode, server in servers.items():
        first = (await chat(server, tools=TOOLS, tool_choice=NAMED)).choices[0].message
        call = first.tool_calls[0]
        history = [*ASK,
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": call.id, "type": "function",
                        "function": {"name": call.function.name,
                                     "arguments": call.function.arguments}}]},
                   {"role": "tool", "tool_call_id": call.id,
                    "content": "Sunny, 24 degrees celsius."}]
        second = await chat(server, messages=history, tools=TOOLS, tool_choice="none")
        choice = second.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert choice.message.content and not choice.message.tool_calls
        # the tool's answer is part of the prompt the template rendered
        silent = {"role": "tool", "tool_call_id": call.id, "content": ""}
        without = await chat(server, messages=[*history[:2], silent], tools=TOOLS,
                             tool_choice="none", max_tokens=1)
        assert second.usage.prompt_tokens > without.usage.prompt_tokens
        answers[mode] = choice.message.content
    assert answers["disaggregated"] == answers["colocated"]


async def test_auto_reads_hermes_calls_from_the_engine_text(
        servers: dict[str, ServerProcess]) -> None:
    # constrained decoding splits text into many small tokens
    held = {"extra_body": {"structured_outputs": {"regex": HERMES_REGEX}}, "max_tokens": 160}
    seen = {}
    for mode, server in servers.items():
        whole = (await chat(server, tools=TOOLS, tool_choice="auto", **held)).choices[0]
        assert whole.finish_reason == "tool_calls", mode
        assert whole.message.content == "Checking. "
        calls = calls_of(whole.message)
        assert [n for n, _ in calls] == ["get_weather"]
        obey(calls)
        content, streamed, _, finish = await chat_stream(server, tools=TOOLS,
                                                         tool_choice="auto", **held)
        assert (content, streamed, finish) == ("Checking. ", calls, "tool_calls")
        # tool_choice none: the same text is content
        plain = (await chat(server, tools=TOOLS, tool_choice="none", **held)).choices[0]
        assert plain.message.content.startswith("Checking. <tool_call>{")
        assert not plain.message.tool_calls and plain.finish_reason == "stop"
        seen[mode] = calls
    assert seen["disaggregated"] == seen["colocated"]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [], "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": 5}}}],
      "tool_choice": "required"}, "tools"),  # a schema that does not compile
])
async def test_bad_tools_are_400_naming_the_field(servers: dict[str, ServerProcess],
                                                  body: dict[str, Any], param: str) -> None:
    server = servers["disaggregated"]
    async with client(server) as c:
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model="", messages=ASK, max_tokens=4,
                                            extra_body=body)
        assert err.value.body is not None
        assert err.value.body["param"] == param, err.value.body  # type: ignore[index]
        ok = await c.chat.completions.create(model="", messages=ASK, max_tokens=4)
    assert ok.choices[0].message.content is not None


# -- the sampling fields carried to both engines, and echo -------------------------------------
async def test_logit_bias_and_stop_string_match_colocated(
        servers: dict[str, ServerProcess], tokenizer: Any) -> None:
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    prompt = "The capital of France is"
    got: dict[str, Any] = {}
    for mode, server in servers.items():
        async with PdserveClient(server.target) as grpc_client:
            free = await grpc_client.generate(text=prompt, max_tokens=8, temperature=0.0)
            banned = await grpc_client.generate(text=prompt, max_tokens=8, temperature=0.0,
                                                logit_bias={paris[0]: -100.0})
            forced = await grpc_client.generate(text=prompt, max_tokens=4, temperature=0.0,
                                                logit_bias={paris[0]: 100.0})
        assert free.token_ids[0] == paris[0], (mode, free.text)  # the greedy first token
        assert paris[0] not in banned.token_ids
        assert forced.token_ids == paris * 4
        async with client(server) as c:
            kw: dict[str, Any] = {"model": "", "prompt": prompt, "max_tokens": 8,
                                  "temperature": 0, "stop": ["Paris"]}
            cut = await c.completions.create(**kw)
            kept = await c.completions.create(**kw, extra_body={
                "include_stop_str_in_output": True})
            http_banned = await c.completions.create(
                model="", prompt=prompt, max_tokens=8, temperature=0,
                logit_bias={str(paris[0]): -100})
        assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
        assert kept.choices[0].text == cut.choices[0].text + "Paris"
        assert http_banned.choices[0].text == banned.text
        got[mode] = (free.token_ids, banned.token_ids, kept.choices[0].text)
    assert got["disaggregated"] == got["colocated"]


async def test_echo_starts_the_answer_with_the_prompt(servers: dict[str, ServerProcess],
                                                      tokenizer: Any) -> None:
    prompt = "The capital of France is"
    for server in servers.values():
        async with client(server) as c:
            plain = await c.completions.create(model="", prompt=prompt, max_tokens=6,
                                               temperature=0)
            echoed = await c.completions.create(model="", prompt=prompt, max_tokens=6,
                                                temperature=0, echo=True)
            stream = await c.completions.create(model="", prompt=prompt, max_tokens=6,
                                                temperature=0, echo=True, stream=True)
            pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
            ids = tokenizer.encode(prompt)
            by_ids = await c.completions.create(model="", prompt=ids, max_tokens=6,
                                                temperature=0, echo=True)
        assert echoed.choices[0].text == prompt + plain.choices[0].text
        assert pieces[0] == prompt and "".join(pieces) == echoed.choices[0].text
        assert by_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
        assert echoed.usage is not None and plain.usage is not None
        assert echoed.usage.completion_tokens == plain.usage.completion_tokens
