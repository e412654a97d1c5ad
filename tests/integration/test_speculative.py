"""Speculative decoding (vLLM's ngram proposer) on the decode worker of a disaggregated
stack: greedy output stays token-identical to vLLM's offline run, the proposer drafts from
the prompt and the prefill worker's first token (its drafts are accepted on a repetitive
prompt, counted by vLLM's own metrics on the decode worker), and the prefill worker runs
without it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.api.client import PdserveClient
from tests.conftest import REFERENCE_MAX_TOKENS, start_disagg
from tests.helpers.prompts import TEXT_PROMPTS
from tests.helpers.servers import DisaggStack, ServerProcess, scrape

pytestmark = pytest.mark.engine

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                    "prompt_lookup_max": 4, "prompt_lookup_min": 2})
# Text that repeats itself: an ngram proposer's drafts are right most of the time.
REPETITIVE = "one two three four five six seven eight. " * 6 + "one two three"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"


@pytest.fixture(scope="module")
async def disagg_ngram(model_path: Path, session_dir: Path) -> AsyncIterator[DisaggStack]:
    async for stack in start_disagg(session_dir, "grpc", "--speculative-config", NGRAM):
        yield stack


async def greedy_ids(target: str, text: str, max_tokens: int, **extra: object) -> list[int]:
    async with PdserveClient(target) as client:
        result = await client.generate(text=text, temperature=0.0, max_tokens=max_tokens,
                                       **extra)
    return list(result.token_ids)


def counter(metrics: dict[str, float], name: str) -> float:
    return metrics.get(name, 0.0)


async def test_greedy_output_matches_offline_vllm(
        disagg_ngram: DisaggStack, offline_reference: list[dict[str, Any]]) -> None:
    for prompt, ref in zip(TEXT_PROMPTS, offline_reference, strict=True):
        got = await greedy_ids(disagg_ngram.server.target, prompt, REFERENCE_MAX_TOKENS)
        assert got == ref["token_ids"], prompt[:40]


async def test_decode_worker_accepts_drafts_and_prefill_runs_none(
        disagg_ngram: DisaggStack, colocated: ServerProcess) -> None:
    before = counter(scrape(disagg_ngram.decode_metrics), ACCEPTED)
    got = await greedy_ids(disagg_ngram.server.target, REPETITIVE, 32, ignore_eos=True)
    # the same tokens as an engine that speculates nothing
    assert got == await greedy_ids(colocated.target, REPETITIVE, 32, ignore_eos=True)
    decode = scrape(disagg_ngram.decode_metrics)
    assert counter(decode, DRAFTS) > 0, "the decode worker proposed no drafts"
    assert counter(decode, ACCEPTED) > before, "no draft was accepted on a repetitive prompt"
    prefill = scrape(disagg_ngram.prefill_metrics)
    assert counter(prefill, DRAFTS) == 0, "the prefill worker ran a proposer"
