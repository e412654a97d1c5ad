"""The disaggregated pair with KV over NIXL (`--kv-transport nixl`), shared memory off so
that the two workers of this one host really go through NIXL's UCX path: token identity
with offline vLLM and with the colocated engine, and proof that NIXL carried the KV."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.api.client import PdserveClient
from tests.conftest import REFERENCE_MAX_TOKENS, start_disagg
from tests.helpers.prompts import TEXT_PROMPTS
from tests.helpers.servers import DisaggStack, ServerProcess
from tests.integration.test_disagg import check_identical

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
async def disagg_nixl(model_path: Path, session_dir: Path) -> AsyncIterator[DisaggStack]:
    async for stack in start_disagg(session_dir, "nixl", "--no-kv-shm"):
        yield stack


async def test_greedy_output_matches_offline_vllm(
    disagg_nixl: DisaggStack, offline_reference: list[dict[str, Any]]
) -> None:
    decoded = 0
    async with PdserveClient(disagg_nixl.server.target) as client:
        for prompt, ref in zip(TEXT_PROMPTS, offline_reference, strict=True):
            result = await client.generate(
                text=prompt, temperature=0.0, max_tokens=REFERENCE_MAX_TOKENS
            )
            assert result.token_ids == ref["token_ids"], prompt[:40]
            if len(result.token_ids) > 1:  # else done at token 1: no decode, nothing shipped
                decoded += 1
                assert result.timings.get("kv_transfer_bytes", 0) > 0, "the KV was not shipped"
    assert decoded >= len(TEXT_PROMPTS) - 1


async def test_greedy_output_identical_to_colocated(
    disagg_nixl: DisaggStack,
    colocated: ServerProcess,
    tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    await check_identical(disagg_nixl, colocated, tokenizer)


async def test_transfer_went_over_nixl(disagg_nixl: DisaggStack) -> None:
    async with PdserveClient(disagg_nixl.server.target) as client:
        result = await client.generate(
            token_ids=list(range(100, 400)), temperature=0.0, max_tokens=4, ignore_eos=True
        )
    assert result.timings["kv_transfer_bytes"] > 0
    # With shm off, the prefill worker's nixl sender took the transfer (its agent came
    # up), and it WRITEs over NIXL unless it hands the transfer to gRPC, which it logs.
    log = disagg_nixl.server.log_path.read_text(errors="replace")
    assert "Initialized NIXL agent" in log
    assert "not NIXL" not in log
