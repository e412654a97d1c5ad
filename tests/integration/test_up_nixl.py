"""`pdserve up --kv-transport nixl` (Ray, redis-server, vLLM workers as actors), shared
memory off so that the two workers of this one host really go through NIXL: greedy output
token-identical to offline vLLM, and the prefill worker's fallback counter shows NIXL
carried the KV (every same-host transfer counted as off shm, none handed to gRPC)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.api.client import PdserveClient
from tests.conftest import REFERENCE_MAX_TOKENS
from tests.helpers.prompts import TEXT_PROMPTS
from tests.helpers.servers import scrape
from tests.integration.test_launcher import Up

pytestmark = [pytest.mark.engine, pytest.mark.slow]

FALLBACKS = "pdserve_kv_transport_fallbacks_total"


@pytest.fixture(scope="module")
async def up_nixl(session_dir: Path, model_path: Path) -> AsyncIterator[Up]:
    workdir = session_dir / "up-nixl"
    workdir.mkdir(exist_ok=True)
    stack = Up(workdir, "--kv-transport", "nixl", "--no-kv-shm")
    async with stack.serving() as running:
        yield running


async def test_greedy_output_matches_offline_vllm_over_nixl(
    up_nixl: Up, offline_reference: list[dict[str, Any]]
) -> None:
    records = await up_nixl.records()
    assert {r.kv_transport for r in records if r.role == "decode"} == {"nixl"}
    shipped = 0
    async with PdserveClient(f"127.0.0.1:{up_nixl.port}") as client:
        for prompt, ref in zip(TEXT_PROMPTS, offline_reference, strict=True):
            result = await client.generate(
                text=prompt, temperature=0.0, max_tokens=REFERENCE_MAX_TOKENS
            )
            assert result.token_ids == ref["token_ids"], prompt[:40]
            if len(result.token_ids) > 1:  # else done at token 1: nothing shipped
                assert result.timings.get("kv_transfer_bytes", 0) > 0, "the KV was not shipped"
                shipped += 1
    assert shipped >= len(TEXT_PROMPTS) - 1
    # The prefill worker counts each same-host transfer that did not use shm ("off");
    # one that NIXL handed to gRPC would be counted under a nixl reason.
    (prefill,) = [r for r in records if r.role == "prefill"]
    deadline = time.monotonic() + 30  # vLLM exports connector stats with its step stats
    while not scrape(prefill.metrics_port, reason="shm_disabled").get(FALLBACKS):
        assert time.monotonic() < deadline, "the prefill worker exported no fallback count"
        await asyncio.sleep(0.5)
    for reason in ("receiver_refuses_nixl", "nixl_staging_full"):
        assert scrape(prefill.metrics_port, reason=reason).get(FALLBACKS, 0.0) == 0.0
