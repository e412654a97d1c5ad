"""Property-based tests: whatever a client sends, validation and the OpenAI body mapping
either accept it (and then the engine would too) or refuse it with a client error that
names a field. No other exception ever escapes."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pdserve.v1 import generate_pb2 as pb
from services import limits
from services.api import validation as v
from services.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_request,
    completion_request,
)
from services.engine.structured import check_structured
from services.errors import ClientError

LIMITS = limits.Limits(served_model="m", max_model_len=128, vocab_size=1000)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sampling(draw: st.DrawFn) -> pb.SamplingParams:
    s = pb.SamplingParams()
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if draw(st.booleans()):
            setattr(s, name, draw(FLOATS))
    for name in ("top_k", "max_tokens", "logprobs"):
        if draw(st.booleans()):
            setattr(s, name, draw(INT32))
    s.min_tokens = draw(INT32)
    s.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    s.stop_token_ids.extend(draw(st.lists(INT32, max_size=70)))
    s.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        s.seed = draw(st.integers(min_value=0, max_value=2**64 - 1))
    return s


@SETTINGS
@given(s=sampling(), prompt_len=st.integers(min_value=0, max_value=200))
def test_sampling_is_accepted_within_vllms_limits_or_refused(s: pb.SamplingParams,
                                                             prompt_len: int) -> None:
    try:
        checked = limits.check_sampling(s, LIMITS)
        max_tokens = limits.resolve_max_tokens(checked, prompt_len, LIMITS)
    except ClientError as e:
        assert e.message.split(":")[0], e.message  # names what is wrong
        return
    # What passed is within what vLLM's SamplingParams accepts.
    assert 1 <= max_tokens <= LIMITS.max_model_len - prompt_len
    assert 0 <= checked.min_tokens <= max_tokens
    for value in (checked.temperature, checked.top_p, checked.min_p,
                  checked.presence_penalty, checked.frequency_penalty,
                  checked.repetition_penalty):
        assert value is None or math.isfinite(value)
    assert checked.temperature is None or 0 <= checked.temperature <= 2
    assert checked.repetition_penalty is None or checked.repetition_penalty > 0


@SETTINGS
@given(data=st.binary(max_size=200))
def test_any_bytes_as_a_request(data: bytes) -> None:
    from services.api.servicer import parse_request

    parsed = parse_request(data)
    if isinstance(parsed, ClientError):
        return
    req = parsed
    try:
        v.check_request_id(req.request_id)
        v.check_model(req.model, LIMITS)
        v.check_input(req, LIMITS)
        limits.check_sampling(req.sampling, LIMITS)
    except ClientError:
        pass


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "n", "stop", "seed", "logprobs", "top_logprobs", "stream",
          "stream_options", "ignore_eos", "min_tokens", "presence_penalty", "echo", "user",
          "response_format", "structured_outputs"]


@SETTINGS
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=8),
       chat=st.booleans())
def test_any_openai_body(body: dict[str, Any], chat: bool) -> None:
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        parsed = model.model_validate(body)
    except ValidationError:
        return  # FastAPI answers these 400 before our mapping runs
    try:
        req = (chat_request(parsed, "r") if isinstance(parsed, ChatCompletionRequest)
               else completion_request(parsed, "r"))  # type: ignore[arg-type]
        sampling = limits.check_sampling(req.sampling, LIMITS)
        if sampling.structured is not None:
            check_structured(sampling.structured)
    except ClientError:
        pass


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 1e30, 2.01])
def test_vllm_limits_on_temperature(value: float) -> None:
    with pytest.raises(ClientError, match=r"sampling\.temperature"):
        limits.check_sampling(pb.SamplingParams(temperature=value), LIMITS)


# Schema-shaped JSON: the keywords a JSON schema uses, with any values.
SCHEMA_KEYS = ["type", "properties", "items", "required", "enum", "const", "minLength",
               "maxLength", "pattern", "anyOf", "oneOf", "allOf", "$ref", "$defs",
               "additionalProperties", "minimum", "maximum", "format", "minItems"]
SCHEMA_LIKE = st.recursive(
    st.sampled_from(["object", "string", "integer", "number", "array", "boolean", "null"])
    | st.integers(-5, 5) | st.booleans() | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.sampled_from(SCHEMA_KEYS) | st.text(max_size=4), children,
                      max_size=4),
    max_leaves=10)
CONSTRAINTS = st.one_of(
    st.fixed_dictionaries({"json": SCHEMA_LIKE | JSON}),
    st.fixed_dictionaries({"regex": st.text(max_size=24)}),
    st.fixed_dictionaries({"grammar": st.text(max_size=40)
                           | st.builds(lambda a: f'root ::= "{a}"', st.text(max_size=8))}),
    st.fixed_dictionaries({"choice": st.lists(st.text(max_size=6), max_size=4) | JSON}),
    st.fixed_dictionaries({"json_object": JSON}),
    st.dictionaries(st.text(max_size=10), JSON, max_size=3),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(constraint=CONSTRAINTS, schema=SCHEMA_LIKE, openai_format=st.booleans())
def test_any_constraint(constraint: dict[str, Any], schema: Any, openai_format: bool) -> None:
    """Any output constraint, in either body form, is accepted (it compiles) or refused
    with a client error naming a field; the compile check never raises anything else."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]}
    if openai_format:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema}}
    else:
        body["structured_outputs"] = constraint
    try:
        req = chat_request(ChatCompletionRequest.model_validate(body), "r")
        parsed = limits.check_sampling(req.sampling, LIMITS)
        if parsed.structured is not None:
            check_structured(parsed.structured)
    except ClientError as e:
        assert e.message.split(":")[0].strip(), e.message
