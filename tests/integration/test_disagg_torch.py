"""The same disaggregated pair with KV over torch.distributed (gloo on CPU)."""

from __future__ import annotations

import pytest

from services.api.client import PdserveClient
from tests.helpers.servers import DisaggStack, ServerProcess
from tests.integration.test_disagg import check_identical

pytestmark = pytest.mark.engine


async def test_greedy_output_identical_to_colocated(
    disagg_torch: DisaggStack, colocated: ServerProcess, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    await check_identical(disagg_torch, colocated, tokenizer)


async def test_transfer_went_over_torch(disagg_torch: DisaggStack) -> None:
    async with PdserveClient(disagg_torch.server.target) as client:
        result = await client.generate(token_ids=list(range(100, 400)), temperature=0.0,
                                       max_tokens=4, ignore_eos=True)
    assert result.timings["kv_transfer_bytes"] > 0
