"""Shipping only the KV blocks the decode worker lacks, on real vLLM engines: a decode
worker whose prefix cache holds the start of a prompt receives only the blocks after it,
and the greedy answer is the colocated engine's, token for token. When the decode worker
does not hold what the router believed, it computes the prompt itself: same tokens, and a
counter says so."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services.api.client import PdserveClient
from services.errors import InvalidRequest
from services.kv.reuse import REUSED_PREFIX_GONE
from services.messages import Delta, GenerationRequest, Sampling
from services.router.orchestrator import Peer, run_pair
from tests.helpers.prompts import prompt_of_length
from tests.helpers.servers import DisaggStack, ServerProcess, scrape

pytestmark = pytest.mark.engine

MAX_TOKENS = 10
GREEDY = Sampling(temperature=0.0, ignore_eos=True)
FALLBACKS = "pdserve_kv_reuse_fallbacks_total"


@dataclass
class Pair:
    prefill: Peer
    decode: Peer
    target: wpb.KVTarget
    block_size: int
    metrics_port: int

    async def run(self, ids: list[int], reuse_tokens: int) -> tuple[list[int], Delta]:
        """A greedy answer through `run_pair`, as the router runs it, with this hint."""
        req = GenerationRequest(uuid.uuid4().hex, ids, GREEDY, MAX_TOKENS)
        tokens: list[int] = []
        last = None
        async for delta in run_pair(req, self.prefill, self.decode, self.target,
                                    reuse_tokens=reuse_tokens):
            tokens += delta.token_ids
            last = delta
        assert last is not None and last.finished
        return tokens, last


@pytest.fixture
async def pair(disagg_grpc: DisaggStack, request: pytest.FixtureRequest
               ) -> AsyncIterator[Pair]:
    """The stack's two workers as `run_pair` reaches them; the KV goes over gRPC, or with
    the parameter "shm" through shared memory (both workers share this host)."""
    same_host = getattr(request, "param", "grpc") == "shm"
    async with grpc.aio.insecure_channel(disagg_grpc.prefill_target) as pc, \
            grpc.aio.insecure_channel(disagg_grpc.decode_target) as dc:
        info = await wpb_grpc.DecodeServiceStub(dc).GetWorkerInfo(wpb.GetWorkerInfoRequest())
        target = wpb.KVTarget(worker_id=info.worker_id, epoch=info.epoch,
                              kv_address=info.kv_address, kv_transport=info.kv_transport,
                              fingerprint_digest=info.fingerprint_digest,
                              same_host=same_host)
        block_size = int(json.loads(info.fingerprint_json)["block_size"])
        yield Pair(Peer("prefill", pc), Peer(info.worker_id, dc), target, block_size,
                   disagg_grpc.decode_metrics)


async def colocated_greedy(colocated: ServerProcess, ids: list[int]) -> list[int]:
    async with PdserveClient(colocated.target) as client:
        result = await client.generate(token_ids=ids, temperature=0.0, max_tokens=MAX_TOKENS,
                                       ignore_eos=True)
    return list(result.token_ids)


@pytest.mark.parametrize("pair", ["grpc", "shm"], indirect=True)
async def test_a_cached_prefix_is_not_shipped_and_the_answer_is_unchanged(
        pair: Pair, colocated: ServerProcess, tokenizer) -> None:  # type: ignore[no-untyped-def]
    bs = pair.block_size
    # Turn 1 ships every block; the decode worker's prefix cache then holds the prompt's
    # full blocks.
    route = "shm" if pair.target.same_host else "grpc"
    turn1 = prompt_of_length(tokenizer, 2 * bs + 44, salt=f"reuse turn one {route}")
    tokens1, last1 = await pair.run(turn1, 0)
    assert tokens1 == await colocated_greedy(colocated, turn1)
    whole = last1.timings.kv_transfer_bytes
    assert whole > 0 and last1.timings.kv_prompt_bytes == whole
    assert last1.timings.kv_reused_tokens == 0
    block_bytes = whole // 3
    # Turn 2 shares turn 1's two full blocks, then goes its own way over two more.
    turn2 = turn1[: 2 * bs] + prompt_of_length(tokenizer, bs + 60, salt=f"reuse turn two {route}")
    tokens2, last2 = await pair.run(turn2, 2 * bs)
    assert tokens2 == await colocated_greedy(colocated, turn2)
    t = last2.timings
    # blocks 2 and 3 of four travelled; 0 and 1 came from the decode worker's own cache
    assert t.kv_transfer_bytes == 2 * block_bytes, (t.kv_transfer_bytes, block_bytes)
    assert t.kv_prompt_bytes == 4 * block_bytes
    assert t.kv_reused_tokens == 2 * bs


async def test_a_prefix_the_decode_worker_does_not_hold_is_computed_there(
        pair: Pair, colocated: ServerProcess, tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The router's belief is wrong (here: a prompt the decode worker never saw; in
    # production: blocks evicted between the router's choice and the Decode call).
    ids = prompt_of_length(tokenizer, 3 * pair.block_size + 9, salt="reuse never seen")
    before = scrape(pair.metrics_port, reason=REUSED_PREFIX_GONE).get(FALLBACKS, 0.0)
    tokens, last = await pair.run(ids, 2 * pair.block_size)
    assert tokens == await colocated_greedy(colocated, ids)
    t = last.timings
    assert t.kv_transfer_bytes == 0 and t.kv_reused_tokens == 0  # the transfer went unread
    assert scrape(pair.metrics_port, reason=REUSED_PREFIX_GONE)[FALLBACKS] == before + 1


async def test_a_hint_that_is_not_whole_blocks_is_refused(pair: Pair, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = prompt_of_length(tokenizer, 300, salt="reuse bad hint")
    with pytest.raises(InvalidRequest, match="whole number of KV blocks"):
        await pair.run(ids, pair.block_size - 1)
