"""Layer-wise shipping off (`--no-kv-layerwise`): the prefill worker sends each step's
layers after its forward pass instead of each layer as it is computed. Only when the
bytes leave changes: the decode worker receives the whole KV and greedy output is
token-identical to colocated."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.api.client import PdserveClient
from tests.helpers.servers import DisaggStack, ServerProcess, scrape

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CHATS = [[("user", "What is the capital of France?")],
         [("user", "Write two sentences about a lighthouse keeper and the sea.")]]


async def test_shipping_after_the_pass_gives_the_colocated_tokens(
        colocated: ServerProcess, session_dir: Path) -> None:
    stack = DisaggStack.create(session_dir / "disagg-whole-pass.log", "grpc",
                               "--no-kv-layerwise")
    async with stack.server.running(timeout=600):
        for chat in CHATS:
            async with PdserveClient(colocated.target) as client:
                want = await client.generate(chat=chat, temperature=0.0, max_tokens=24)
            async with PdserveClient(stack.server.target) as client:
                got = await client.generate(chat=chat, temperature=0.0, max_tokens=24)
            assert got.token_ids == want.token_ids, chat
        received = scrape(stack.decode_metrics).get("pdserve_kv_transfer_bytes_total", 0.0)
        assert received > 0, "no KV reached the decode worker"
