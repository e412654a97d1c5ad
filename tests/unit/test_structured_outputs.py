"""Output constraints without an engine: the public field's forms and sizes, the
compile check (vLLM's own xgrammar validation), the trip through the worker API, the
resumed count a moved request carries, and the OpenAI bodies that map onto it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdserve.v1 import generate_pb2 as pb
from services import wire
from services.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    openai_error,
)
from services.engine.structured import RESUME_KEY, check_structured, resume_count
from services.errors import InvalidRequest, PdserveError
from services.limits import MAX_STRUCTURED_CHARS, Limits, check_sampling
from services.messages import GenerationRequest, Sampling, Structured

LIMITS = Limits("m", 64, 200)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def parse(st: pb.StructuredOutput) -> Structured | None:
    return check_sampling(pb.SamplingParams(structured=st), LIMITS).structured


@pytest.mark.parametrize(("st", "expected"), [
    (pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), Structured("json", json.dumps(SCHEMA))),
    (pb.StructuredOutput(regex="[a-z]+"), Structured("regex", "[a-z]+")),
    (pb.StructuredOutput(choice=pb.Choices(choices=["x", "y"])), Structured("choice", ("x", "y"))),
    (pb.StructuredOutput(grammar='root ::= "a"'), Structured("grammar", 'root ::= "a"')),
    (pb.StructuredOutput(json_object=True), Structured("json_object")),
    (pb.StructuredOutput(), None),
])
def test_forms_round_trip_through_the_worker_api(st: pb.StructuredOutput,
                                                 expected: Structured | None) -> None:
    assert parse(st) == expected
    sampling = Sampling(structured=expected)
    assert check_sampling(wire.sampling_pb(sampling, 4, 0), LIMITS).structured == expected
    assert "structured" not in sampling.vllm_kwargs()


@pytest.mark.parametrize(("st", "needle"), [
    (pb.StructuredOutput(json_object=False), "sampling.structured.json_object: must be true"),
    (pb.StructuredOutput(choice=pb.Choices()), "sampling.structured.choice.choices: at least"),
    (pb.StructuredOutput(choice=pb.Choices(choices=["a", ""])),
     "sampling.structured.choice.choices[1]: empty"),
    (pb.StructuredOutput(json_schema="  "), "sampling.structured.json_schema: empty"),
    (pb.StructuredOutput(grammar=""), "sampling.structured.grammar: empty"),
    (pb.StructuredOutput(regex="a" * (MAX_STRUCTURED_CHARS + 1)),
     f"sampling.structured.regex: {MAX_STRUCTURED_CHARS + 1} characters"),
])
def test_form_refusals_name_the_field(st: pb.StructuredOutput, needle: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse(st)
    assert err.value.message.startswith(needle)


@pytest.mark.parametrize(("st", "field"), [
    (Structured("json", "{not json"), "sampling.structured.json_schema"),
    (Structured("json", '{"type": "object", "properties": 5}'), "sampling.structured.json_schema"),
    (Structured("json", json.dumps({"type": "integer", "multipleOf": 3})),
     "sampling.structured.json_schema"),  # a feature xgrammar does not implement
    (Structured("regex", "(unclosed"), "sampling.structured.regex"),
    (Structured("regex", "a\x00b"), "sampling.structured.regex"),
    (Structured("grammar", "root ::= undefined_rule"), "sampling.structured.grammar"),
])
def test_compile_check_refuses_what_the_engine_would(st: Structured, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_structured(st)
    assert err.value.message.startswith(field + ": ")


@pytest.mark.parametrize("st", [
    Structured("json", json.dumps(SCHEMA)), Structured("regex", "[0-9]{3}"),
    Structured("choice", ("yes", "no")), Structured("grammar", 'root ::= "a" | "b"'),
    Structured("json_object"),
])
def test_compile_check_passes_good_constraints(st: Structured) -> None:
    check_structured(st)


def test_a_moved_request_counts_the_answer_it_resumes_after() -> None:
    req = GenerationRequest("r", [1, 2, 3], Sampling(), max_tokens=10)
    once = req.continued([7, 8])
    assert once.prompt_token_ids == [1, 2, 3, 7, 8] and once.generated_tokens == 2
    # The router continues from the original request with everything streamed so far.
    assert req.continued([7, 8, 9]).generated_tokens == 3


@dataclass
class FakeParams:
    """Stands in for vLLM's SamplingParams (only extra_args is read)."""

    extra_args: dict[str, Any] | None = None


@dataclass
class FakeRequest:
    """Stands in for vLLM's engine-side Request (prompt and sampling params only)."""

    prompt_token_ids: list[int] = field(default_factory=lambda: [5, 6, 7])
    sampling_params: FakeParams | None = None


@pytest.mark.parametrize(("extra", "expected"), [
    (None, 0), ({}, 0), ({RESUME_KEY: 1}, 1), ({RESUME_KEY: 2}, 2),
    ({RESUME_KEY: 3}, 0),  # the whole prompt: at least one prompt token is the prompt
    ({RESUME_KEY: -1}, 0), ({RESUME_KEY: "1"}, 0),
])
def test_resume_count_is_read_defensively(extra: dict[str, Any] | None, expected: int) -> None:
    request: Any = FakeRequest(sampling_params=FakeParams(extra))
    assert resume_count(request) == expected


# -- OpenAI bodies ----------------------------------------------------------------------
CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(("extra", "expected"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     pb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_object"}}, pb.StructuredOutput(json_object=True)),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, pb.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[a-z]"}}, pb.StructuredOutput(regex="[a-z]")),
    ({"structured_outputs": {"choice": ["a", "b"]}},
     pb.StructuredOutput(choice=pb.Choices(choices=["a", "b"]))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     pb.StructuredOutput(grammar='root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, pb.StructuredOutput(json_object=True)),
])
def test_openai_bodies_map_to_the_structured_field(extra: dict[str, Any],
                                                   expected: pb.StructuredOutput | None) -> None:
    for req in (chat_request(ChatCompletionRequest(**CHAT, **extra), "r"),
                completion_request(CompletionRequest(prompt="x", **extra), "r")):
        if expected is None:
            assert not req.sampling.HasField("structured")
        else:
            assert req.sampling.structured == expected


@pytest.mark.parametrize(("extra", "needle"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format.json_schema.schema: required"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format: set either"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs: set exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern: not supported"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs.choice: a list"),
])
def test_openai_constraint_refusals(extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(PdserveError) as err:
        chat_request(ChatCompletionRequest(**CHAT, **extra), "r")
    assert err.value.message.startswith(needle)


@pytest.mark.parametrize(("origin", "param"), [
    ("response_format", "response_format"), ("structured_outputs", "structured_outputs.json"),
])
def test_compile_errors_name_the_body_field(origin: str, param: str) -> None:
    err = InvalidRequest("sampling.structured.json_schema: Invalid JSON grammar specification.")
    status, body = openai_error(err, chat=True, structured=origin)
    assert status == 400
    assert body["error"]["param"] == param
    assert body["error"]["message"] == f"{param}: Invalid JSON grammar specification."
