"""The public gRPC API on a real colocated vLLM engine and the real default model."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from pdserve.v1 import generate_pb2 as pb
from services.api.client import PdserveClient, build_request, collect
from tests.conftest import REFERENCE_MAX_TOKENS
from tests.helpers.prompts import TEXT_PROMPTS
from tests.helpers.servers import ServerProcess

pytestmark = pytest.mark.engine


async def test_greedy_output_matches_offline_vllm(
    colocated: ServerProcess, offline_reference: list[dict[str, Any]]
) -> None:
    assert len(TEXT_PROMPTS) >= 5
    assert max(len(r["prompt_token_ids"]) for r in offline_reference) > 128
    async with PdserveClient(colocated.target) as client:
        for prompt, ref in zip(TEXT_PROMPTS, offline_reference, strict=True):
            result = await client.generate(
                text=prompt, temperature=0.0, max_tokens=REFERENCE_MAX_TOKENS
            )
            assert result.token_ids == ref["token_ids"], prompt[:40]
            assert result.text == ref["text"]
            assert result.prompt_tokens == len(ref["prompt_token_ids"])


async def test_chat_answers_paris(colocated: ServerProcess) -> None:
    async with PdserveClient(colocated.target) as client:
        result = await client.generate(
            chat=[("user", "What is the capital of France?")], temperature=0.0, max_tokens=32
        )
    assert "Paris" in result.text
    assert result.finish_reason == "stop"


async def test_deltas_concatenate_and_usage_matches(colocated: ServerProcess, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = "List five fruits, one per line:"
    async with PdserveClient(colocated.target) as client:
        pieces = [p async for p in client.stream(text=prompt, temperature=0.0, max_tokens=40)]
        result = await client.generate(text=prompt, temperature=0.0, max_tokens=40)
    assert len(pieces) > 1
    ids = [t for p in pieces for t in p.token_ids]
    assert ids == result.token_ids
    assert "".join(p.text for p in pieces) == result.text
    assert result.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert result.completion_tokens == len(ids)
    assert result.prompt_tokens == len(tokenizer.encode(prompt))
    assert result.finish_reason in ("stop", "length")
    t = result.timings
    assert 0 < t["ttft_s"] <= t["e2e_s"]
    assert t["prefill_s"] > 0 and t["decode_s"] > 0


async def test_token_ids_input_and_stop_string(colocated: ServerProcess, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("Count: one, two, three, four,")
    async with PdserveClient(colocated.target) as client:
        free = await client.generate(token_ids=ids, temperature=0.0, max_tokens=12)
        stop_at = free.text.strip().split()[1]  # a word the model really produces
        stopped = await client.generate(
            token_ids=ids, temperature=0.0, max_tokens=12, stop=[stop_at]
        )
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop_at
    assert stop_at not in stopped.text
    assert free.text.startswith(stopped.text)


async def test_logprobs(colocated: ServerProcess) -> None:
    async with PdserveClient(colocated.target) as client:
        call = client.call(build_request(text="Hello", temperature=0.0, max_tokens=4, logprobs=3))
        chunks = [r.chunk async for r in call if r.HasField("chunk")]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert len(logprobs) == 4
    for lp in logprobs:
        assert lp.logprob <= 0
        # greedy: the chosen token is at least as likely as every alternative
        assert all(lp.logprob >= alt.logprob - 1e-5 for alt in lp.top)


def _long_prompt(n_tokens: int) -> list[int]:
    return [100 + (i % 1000) for i in range(n_tokens)]


BAD_REQUESTS: list[tuple[str, dict[str, Any], grpc.StatusCode, str]] = [
    ("empty text", {"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, "text"),
    ("blank text", {"text": "   "}, grpc.StatusCode.INVALID_ARGUMENT, "text"),
    ("no input", {}, grpc.StatusCode.INVALID_ARGUMENT, "input"),
    ("empty token ids", {"token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    ("empty chat", {"chat": []}, grpc.StatusCode.INVALID_ARGUMENT, "chat.messages"),
    ("prompt longer than context", {"token_ids": _long_prompt(2100)},
     grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("max_tokens zero", {"text": "hi", "max_tokens": 0},
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("max_tokens negative", {"text": "hi", "max_tokens": -5},
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("max_tokens beyond context", {"text": "hi", "max_tokens": 5000},
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("negative temperature", {"text": "hi", "temperature": -0.5},
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("top_p zero", {"text": "hi", "top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("top_p above one", {"text": "hi", "top_p": 1.5},
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("top_k below -1", {"text": "hi", "top_k": -2}, grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    ("token id outside vocabulary", {"token_ids": [1, 2, 999_999]},
     grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    ("negative token id", {"token_ids": [-1]}, grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    ("too many stop strings", {"text": "hi", "stop": [f"s{i}" for i in range(40)]},
     grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ("unknown model", {"text": "hi", "model": "gpt-17"}, grpc.StatusCode.NOT_FOUND, "model"),
]


@pytest.mark.parametrize(("case", "fields", "code", "field"), BAD_REQUESTS,
                         ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_input_gets_status_naming_field(
    colocated: ServerProcess, case: str, fields: dict[str, Any], code: grpc.StatusCode,
    field: str,
) -> None:
    fields = dict(fields)
    req = pb.GenerateRequest(model=fields.pop("model", ""))
    if "text" in fields:
        req.text = fields.pop("text")
    elif "token_ids" in fields:
        req.token_ids.ids.extend(fields.pop("token_ids"))
    elif "chat" in fields:
        req.chat.SetInParent()
        fields.pop("chat")
    req.sampling.CopyFrom(pb.SamplingParams(**fields))
    async with PdserveClient(colocated.target) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(client.call(req, timeout=30))
        assert err.value.code() == code, err.value.details()
        assert field in (err.value.details() or "")
        # the server goes on serving
        ok = await client.generate(text="Hi", temperature=0.0, max_tokens=2)
        assert ok.completion_tokens == 2


async def _engine_idle(server: ServerProcess, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy: {m['vllm:num_requests_running']} running")
        await asyncio.sleep(0.25)


async def test_cancelled_stream_aborts_engine_request(colocated: ServerProcess) -> None:
    async with PdserveClient(colocated.target) as client:
        call = client.call(build_request(text="Tell me a long story.", temperature=0.0,
                                         max_tokens=1000, ignore_eos=True))
        seen = 0
        async for r in call:
            seen += r.HasField("chunk")
            if seen == 3:
                break
        m = colocated.metrics()
        assert m["vllm:num_requests_running"] >= 1
        call.cancel()
        await _engine_idle(colocated)
        # a deadline that passes mid-stream aborts the request too
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(client.call(
                build_request(text="Tell me a long story.", temperature=0.0, max_tokens=1000,
                              ignore_eos=True), timeout=1.5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _engine_idle(colocated)
        ok = await client.generate(text="Hi", temperature=0.0, max_tokens=2)
        assert ok.completion_tokens == 2


async def test_health_reflection_and_model_info(colocated: ServerProcess) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    async with PdserveClient(colocated.target) as client:
        assert await client.health() == "SERVING"
        assert await client.health("pdserve.v1.GenerationService") == "SERVING"
        info = await client.model_info()
    assert info.max_model_len == 2048
    assert info.vocab_size == 49152
    assert info.has_chat_template
    assert info.serving_mode == "colocated"
    assert info.model == "SmolLM2-135M-Instruct-float32"

    with grpc.insecure_channel(colocated.target) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "pdserve.v1.GenerationService" in services
    assert "grpc.health.v1.Health" in services
