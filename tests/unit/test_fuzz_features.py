"""Property-based tests for the request fields applications use beyond plain sampling:
tools and tool_choice, logit_bias, n, include_stop_str_in_output, LoRA adapter names and
adapter folders. Whatever a client (or an operator's folder) holds is accepted, or refused
with a client error whose message starts with the field it names; nothing else escapes.
The tool-call readers are checked the other way round: however an answer is split into
stream chunks, the calls and content read are those of the whole answer."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services import limits
from services.api import tools
from services.api.openai_schema import ChatCompletionRequest, chat_request, tool_plan
from services.engine import lora
from services.engine.structured import check_structured
from services.errors import ClientError

LIMITS = limits.Limits(served_model="m", max_model_len=128, vocab_size=1000)
SETTINGS = settings(max_examples=250, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=10)
NAMES = st.sampled_from(["get_weather", "lookup", "f"]) | st.text(max_size=8)
PARAMS = st.none() | JSON | st.fixed_dictionaries(
    {"type": st.just("object"),
     "properties": st.dictionaries(st.sampled_from(["city", "n", "q"]),
                                   st.fixed_dictionaries({"type": st.sampled_from(
                                       ["string", "integer", "number", "boolean"])}),
                                   max_size=3)},
    optional={"required": st.lists(st.sampled_from(["city", "n", "q"]), max_size=2)})
FUNCTION = st.fixed_dictionaries(
    {"name": NAMES}, optional={"description": st.text(max_size=10) | JSON, "parameters": PARAMS})
TOOL = st.fixed_dictionaries({"function": FUNCTION | JSON},
                             optional={"type": st.sampled_from(["function", "code"]) | JSON})
TOOLS = st.none() | st.lists(TOOL, max_size=3) | JSON
TOOL_CHOICE = (st.none() | st.sampled_from(["none", "auto", "required", "any"]) | JSON
               | st.fixed_dictionaries({"type": st.just("function"),
                                        "function": st.fixed_dictionaries({"name": NAMES})}))


def _field_named(e: ClientError) -> None:
    assert e.message.split(":")[0].strip(), e.message


@SETTINGS
@given(tools_=TOOLS, choice=TOOL_CHOICE, parallel=st.none() | st.booleans(),
       auto=st.none() | st.just("hermes"), logit_bias=st.none() | JSON
       | st.dictionaries(st.text(max_size=6) | st.integers(-5, 2000).map(str),
                         st.floats(allow_nan=True, allow_infinity=True), max_size=4),
       n=st.none() | st.integers(-3, 300), stop_in_output=st.booleans() | JSON)
def test_any_tools_and_sampling_extras(tools_: Any, choice: Any, parallel: bool | None,
                                       auto: str | None, logit_bias: Any, n: int | None,
                                       stop_in_output: Any) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}],
                            "tools": tools_, "tool_choice": choice,
                            "parallel_tool_calls": parallel, "logit_bias": logit_bias, "n": n,
                            "include_stop_str_in_output": stop_in_output}
    try:
        parsed = ChatCompletionRequest.model_validate(body)
    except ValidationError:
        return  # FastAPI answers these 400 before our mapping runs
    try:
        plan = tool_plan(parsed, auto)
        req = chat_request(parsed, "r", plan)
        sampling = limits.check_sampling(req.sampling, LIMITS)
        if sampling.structured is not None:
            check_structured(sampling.structured)
    except ClientError as e:
        _field_named(e)
        return
    # Accepted: a tool plan that forces a call carries its schema as the constraint.
    if plan is not None and plan.choice in ("required", "named"):
        assert req.sampling.HasField("structured")
        json.loads(req.sampling.structured.json_schema)


# Answers as a model writes them: text, Hermes-style <tool_call> blocks with JSON (well
# or badly formed), and raw JSON arrays (what a required/named constraint produces).
CALL_JSON = st.builds(
    lambda name, args: json.dumps({"name": name, "arguments": args}),
    st.sampled_from(["get_weather", "lookup"]), st.dictionaries(st.text(max_size=4), JSON,
                                                                 max_size=2))
PIECES = st.lists(
    st.text(max_size=10) | st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"', "\\"])
    | CALL_JSON.map(lambda j: f"<tool_call>{j}</tool_call>") | CALL_JSON,
    max_size=6)


def _read_in_chunks(make: Any, text: str, cuts: list[int]) -> tuple[str, list[dict[str, Any]],
                                                                   list[dict[str, Any]]]:
    reader = make()
    content, deltas = "", []
    at = 0
    for cut in [*sorted({min(c, len(text)) for c in cuts}), len(text)]:
        out = reader.feed(text[at:cut])
        content += out.content
        deltas += out.tool_calls
        at = cut
    out = reader.finish()
    return content + out.content, deltas + out.tool_calls, reader.tool_calls()


READERS = {"hermes": tools.HermesCalls, "required": tools.RequiredCalls,
           "named": lambda: tools.NamedCall("get_weather"), "none": tools.CallStream}


@SETTINGS
@given(pieces=PIECES, cuts=st.lists(st.integers(0, 400), max_size=12),
       kind=st.sampled_from(sorted(READERS)))
def test_tool_call_readers_do_not_depend_on_chunking(pieces: list[str], cuts: list[int],
                                                     kind: str) -> None:
    text = "".join(pieces)
    whole_content, _, whole_calls = _read_in_chunks(READERS[kind], text, [])
    content, deltas, calls = _read_in_chunks(READERS[kind], text, cuts)
    assert content == whole_content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]
    # The streamed deltas add up to the calls: a header per call, then its arguments.
    joined: dict[int, str] = {}
    for d in deltas:
        joined[d["index"]] = joined.get(d["index"], "") + d["function"]["arguments"]
    assert [joined[i] for i in sorted(joined)] == [c["function"]["arguments"] for c in calls]


@SETTINGS
@given(name=st.text(max_size=80))
def test_any_adapter_name(name: str) -> None:
    try:
        assert lora.check_name(name) == name
    except ClientError as e:
        _field_named(e)
        return
    # Accepted names are usable as `--lora NAME=PATH` entries as they are.
    assert [m.name for m in lora.parse_lora_modules(f"{name}=/a")] == [name]


@SETTINGS
@given(spec=st.text(max_size=60))
def test_any_lora_flag(spec: str) -> None:
    try:
        modules = lora.parse_lora_modules(spec)
    except ValueError as e:
        assert str(e).startswith("lora_modules: "), e
        return
    assert len({m.name for m in modules}) == len(modules)


BASE = lora.BaseModel(weights={"model.layers.0.self_attn.q_proj": (8, 8),
                               "model.layers.0.self_attn.v_proj": (4, 8)},
                      names=frozenset({"tiny"}))
LORA_KEYS = st.sampled_from([
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
    "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight",
]) | st.text(max_size=12)
HEADER = st.dictionaries(
    LORA_KEYS, st.fixed_dictionaries({"dtype": st.just("F32"),
                                      "shape": st.lists(st.integers(0, 9), max_size=3),
                                      "data_offsets": st.just([0, 0])}) | JSON, max_size=4)
CONFIG = st.fixed_dictionaries(
    {}, optional={"peft_type": st.sampled_from(["LORA", "lora", "IA3"]) | JSON,
                  "r": st.integers(-1, 20) | JSON, "lora_alpha": st.integers(1, 32) | JSON,
                  "base_model_name_or_path": st.sampled_from(["org/tiny", "other"]) | JSON,
                  "target_modules": st.lists(st.sampled_from(["q_proj", "v_proj", "o_proj"]),
                                             max_size=3) | JSON}) | JSON


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIG, header=HEADER, raw=st.none() | st.binary(max_size=40))
def test_any_adapter_folder(config: Any, header: Any, raw: bytes | None) -> None:
    """Whatever an adapter folder holds, checking it gives facts or AdapterInvalid."""
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        if raw is None:  # a safetensors header over no data
            blob = json.dumps(header).encode()
            raw = struct.pack("<Q", len(blob)) + blob
        (folder / "adapter_model.safetensors").write_bytes(raw)
        try:
            facts = lora.check_adapter(str(folder), BASE, max_lora_rank=16)
        except lora.AdapterInvalid as e:
            assert e.message.startswith("lora_path: "), e.message
            return
        assert 1 <= facts.rank <= 16
