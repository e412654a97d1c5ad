"""n > 1 answers to one prompt on real engines: colocated (vLLM's parallel sampling) and
disaggregated (one prefill, one KV transfer, then every choice on the decode worker),
greedy and seeded answers the same in both, each choice streamed with its index, over
gRPC and with the real `openai` client."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.api.client import PdserveClient, build_request
from tests.helpers.servers import DisaggStack, ServerProcess, scrape

pytestmark = pytest.mark.engine

CHAT = [("user", "Tell me a short story about a cat.")]
MAX_TOKENS = 16


async def choices(target: str, n: int, **sampling: object
                  ) -> tuple[dict[int, list[int]], dict[int, str], dict[str, float], int]:
    """Each choice's token ids and finish reason, the timings, completion tokens."""
    ids: dict[int, list[int]] = {i: [] for i in range(n)}
    finish: dict[int, str] = {}
    async with PdserveClient(target) as client:
        request = build_request(chat=CHAT, max_tokens=MAX_TOKENS, n=n, **sampling)
        final = None
        async for message in client.stub.Generate(request):
            kind = message.WhichOneof("response")
            if kind == "chunk":
                c = message.chunk
                ids[c.index].extend(c.token_ids)
                if c.finish_reason:
                    assert c.index not in finish, "a choice ended twice"
                    finish[c.index] = c.finish_reason
            else:
                final = message.final
    assert final is not None
    assert set(finish) == set(range(n)), "every choice ends with its finish reason"
    assert final.finish_reason == finish[0]
    assert final.usage.completion_tokens == sum(len(v) for v in ids.values())
    timings = {f.name: v for f, v in final.timings.ListFields()}
    return ids, {i: str(f) for i, f in finish.items()}, timings, final.usage.completion_tokens


async def test_seeded_choices_match_colocated(
    colocated: ServerProcess, disagg_grpc: DisaggStack
) -> None:
    """vLLM refuses n > 1 with greedy sampling; seeded answers are the reproducible ones."""
    for sampling in ({"temperature": 1.0, "seed": 7}, {"temperature": 0.7, "seed": 123,
                                                       "top_k": 20}):
        col, _, _, _ = await choices(colocated.target, 3, **sampling)
        dis, _, timings, _ = await choices(disagg_grpc.server.target, 3, **sampling)
        assert dis == col, sampling
        assert timings.get("kv_transfer_bytes", 0) > 0, "the prompt's KV was not shipped"
        # choice i samples with seed + i: the choices differ from each other
        assert len({tuple(v) for v in col.values()}) > 1


async def test_greedy_n_is_invalid_argument(disagg_grpc: DisaggStack) -> None:
    import grpc

    async with PdserveClient(disagg_grpc.server.target) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(chat=CHAT, max_tokens=4, n=2, temperature=0.0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("sampling.n: 2 answers need sampling")


async def test_one_prefill_and_one_transfer_for_all_choices(disagg_grpc: DisaggStack) -> None:
    # A prefill request ends at its max_tokens of 1: "length".
    before_p = scrape(disagg_grpc.prefill_metrics, finished_reason="length")
    before_d = scrape(disagg_grpc.decode_metrics)
    _, _, timings, _ = await choices(disagg_grpc.server.target, 4, temperature=1.0, seed=1)
    requests = "vllm:request_success_total"
    deadline = time.monotonic() + 10
    while True:  # vLLM publishes its counters with each engine step's stats
        after_p = scrape(disagg_grpc.prefill_metrics, finished_reason="length")
        if after_p.get(requests, 0) > before_p.get(requests, 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)  # a second prefill request would have been counted by now
    after_p = scrape(disagg_grpc.prefill_metrics, finished_reason="length")
    after_d = scrape(disagg_grpc.decode_metrics)
    assert after_p[requests] - before_p.get(requests, 0) == 1  # one prefill request
    shipped = "pdserve_kv_transfer_bytes_total"
    assert after_d[shipped] - before_d.get(shipped, 0) == timings["kv_transfer_bytes"]


async def test_openai_n_choices(colocated: ServerProcess, disagg_grpc: DisaggStack) -> None:
    from openai import AsyncOpenAI

    messages = [{"role": "user", "content": CHAT[0][1]}]
    answers = []
    for server in (colocated, disagg_grpc.server):
        async with AsyncOpenAI(base_url=server.base_url, api_key="unused") as client:
            r = await client.chat.completions.create(
                model="", messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                n=2, temperature=1.0, seed=3)
            assert [c.index for c in r.choices] == [0, 1]
            texts = [c.message.content for c in r.choices]
            streamed = ["", ""]
            ends: dict[int, str] = {}
            stream = await client.completions.create(
                model="", prompt="Once upon a time", max_tokens=MAX_TOKENS, n=2,
                temperature=1.0, seed=3, stream=True)
            async for chunk in stream:
                for c in chunk.choices:
                    streamed[c.index] += c.text
                    if c.finish_reason:
                        ends[c.index] = c.finish_reason
            assert set(ends) == {0, 1}
            answers.append((texts, streamed))
    assert answers[0] == answers[1]
