"""Structured outputs on real engines, colocated and across the prefill -> decode handoff:
the answer obeys its constraint as a whole (the decode worker resumes the constraint
after the prefill worker's token 1 instead of restarting it), greedy disaggregated
output is token-identical to colocated, and a bad constraint is the client's error
while the server keeps serving."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from pdserve.v1 import generate_pb2 as pb
from services.api.client import PdserveClient
from tests.helpers.servers import DisaggStack, ServerProcess

pytestmark = pytest.mark.engine

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
CHAT = [("user", "Give the largest city of France and its population as JSON.")]
# Not a pattern the model would write unasked: each character is the constraint's.
REGEX = r"[0-9]{3}-[a-z]{2}-(yes|no)"
CHOICES = ["Paris", "London", "Berlin"]
MAX_TOKENS = 48


async def answer(target: str, structured: pb.StructuredOutput, **sampling: object
                 ) -> tuple[str, list[int], str]:
    async with PdserveClient(target) as client:
        r = await client.generate(chat=CHAT, max_tokens=MAX_TOKENS, structured=structured,
                                  **sampling)
    return r.text, r.token_ids, r.finish_reason


def constraints() -> list[tuple[pb.StructuredOutput, object]]:
    def valid_json(text: str) -> None:
        jsonschema.validate(json.loads(text), SCHEMA)

    def matches(text: str) -> None:
        assert re.fullmatch(REGEX, text), text

    def chosen(text: str) -> None:
        assert text in CHOICES, text

    def some_object(text: str) -> None:
        assert isinstance(json.loads(text), dict), text

    return [
        (pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), valid_json),
        (pb.StructuredOutput(regex=REGEX), matches),
        (pb.StructuredOutput(choice=pb.Choices(choices=CHOICES)), chosen),
        (pb.StructuredOutput(json_object=True), some_object),
    ]


async def test_greedy_answers_obey_and_match_colocated(
    colocated: ServerProcess, disagg_grpc: DisaggStack
) -> None:
    for structured, check in constraints():
        kind = structured.WhichOneof("kind")
        text_c, ids_c, finish_c = await answer(colocated.target, structured, temperature=0.0)
        text_d, ids_d, finish_d = await answer(disagg_grpc.server.target, structured,
                                               temperature=0.0)
        assert finish_c == finish_d == "stop", (kind, text_c, text_d)
        check(text_c)
        check(text_d)
        assert ids_d == ids_c, kind


async def test_sampled_answers_obey_across_the_handoff(disagg_grpc: DisaggStack) -> None:
    """Sampled tokens go where greedy ones never do; every answer still obeys, which it
    would not if the decode worker restarted the constraint after token 1."""
    for structured, check in constraints()[:2]:
        for seed in range(3):
            text, _, finish = await answer(disagg_grpc.server.target, structured,
                                           temperature=1.0, seed=seed)
            if finish == "stop":  # a "length" answer is cut short: a prefix only
                check(text)


@pytest.mark.parametrize("structured, field", [
    (pb.StructuredOutput(json_schema="{not json"), "sampling.structured.json_schema"),
    (pb.StructuredOutput(json_schema='{"type": "object", "properties": 5}'),
     "sampling.structured.json_schema"),
    (pb.StructuredOutput(regex="(unclosed"), "sampling.structured.regex"),
    (pb.StructuredOutput(grammar="root ::= undefined_rule"), "sampling.structured.grammar"),
    (pb.StructuredOutput(choice=pb.Choices()), "sampling.structured.choice.choices"),
    (pb.StructuredOutput(json_object=False), "sampling.structured.json_object"),
])
async def test_bad_constraint_is_invalid_argument_and_serving_goes_on(
    disagg_grpc: DisaggStack, structured: pb.StructuredOutput, field: str
) -> None:
    async with PdserveClient(disagg_grpc.server.target) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(text="Hi", max_tokens=4, structured=structured)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(field + ":"), err.value.details()
        ok = await client.generate(chat=CHAT, max_tokens=MAX_TOKENS, temperature=0.0,
                                   structured=pb.StructuredOutput(regex=REGEX))
    assert re.fullmatch(REGEX, ok.text)


async def test_workers_refuse_a_bad_constraint_too(disagg_grpc: DisaggStack) -> None:
    """A worker trusts no caller: a constraint that skipped the public API's check is
    refused by the worker's engine front, and the engine keeps serving."""
    from pdserve.v1 import worker_pb2 as wpb
    from pdserve.v1 import worker_pb2_grpc as wpb_grpc

    sampling = pb.SamplingParams(max_tokens=4, structured=pb.StructuredOutput(regex="(bad"))
    async with grpc.aio.insecure_channel(disagg_grpc.decode_target) as channel:
        stub = wpb_grpc.DecodeServiceStub(channel)
        call = stub.Decode(wpb.DecodeRequest(request_id="bad-constraint",
                                             prompt_token_ids=[1, 2, 3], sampling=sampling))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    text, _, _ = await answer(disagg_grpc.server.target, pb.StructuredOutput(regex=REGEX),
                              temperature=0.0)
    assert re.fullmatch(REGEX, text)


# -- the OpenAI API, with the real `openai` client ----------------------------------------
async def test_openai_response_format_and_structured_outputs(
    colocated: ServerProcess, disagg_grpc: DisaggStack
) -> None:
    from openai import AsyncOpenAI

    messages = [{"role": "user", "content": CHAT[0][1]}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    texts = []
    for server in (colocated, disagg_grpc.server):
        async with AsyncOpenAI(base_url=server.base_url, api_key="unused") as client:
            model = (await client.models.list()).data[0].id
            r = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                response_format=fmt)  # type: ignore[arg-type]
            text = r.choices[0].message.content or ""
            jsonschema.validate(json.loads(text), SCHEMA)
            texts.append(text)
            stream = await client.completions.create(
                model=model, prompt="The three primary colours are", max_tokens=8,
                temperature=0, stream=True,
                extra_body={"structured_outputs": {"choice": CHOICES}})
            streamed = "".join([c.choices[0].text async for c in stream if c.choices])
            assert streamed in CHOICES
    assert texts[0] == texts[1]


async def test_openai_bad_schema_is_400_naming_the_field(disagg_grpc: DisaggStack) -> None:
    from openai import AsyncOpenAI, BadRequestError

    messages = [{"role": "user", "content": "Hi"}]
    async with AsyncOpenAI(base_url=disagg_grpc.server.base_url, api_key="unused") as client:
        with pytest.raises(BadRequestError) as err:
            await client.chat.completions.create(
                model="", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                response_format={"type": "json_schema", "json_schema": {
                    "name": "bad", "schema": {"type": "object", "properties": 5}}})
        assert err.value.status_code == 400
        assert err.value.body["param"] == "response_format"  # type: ignore[index]
        with pytest.raises(BadRequestError) as err:
            await client.chat.completions.create(
                model="", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                extra_body={"structured_outputs": {"regex": "(unclosed"}})
        assert err.value.body["param"] == "structured_outputs.regex"  # type: ignore[index]
        r = await client.chat.completions.create(
            model="", messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
            temperature=0, extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, r.choices[0].message.content or "")
