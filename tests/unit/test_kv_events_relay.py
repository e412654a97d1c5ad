"""The worker's KV events relay between vLLM's own ZeroMQ publisher (the class the engine
runs, here without an engine) and the router's subscriber: what vLLM publishes on the
relay's ipc socket reaches the router's index through the port the worker advertises."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.registry.records import WorkerRecord
from services.router.kv_index import KVEventFeeds, KVIndex
from services.worker.kv_events import EventRelay

BS = 4
PROMPT = list(range(200, 213))


async def test_vllms_publisher_reaches_the_router_through_the_relay() -> None:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventPublisherFactory,
        KVEventBatch,
    )

    relay = EventRelay("127.0.0.1")
    config = relay.engine_config()
    assert config.endpoint.startswith("ipc://") and "*" not in config.endpoint
    publisher = EventPublisherFactory.create(config)  # as vLLM's scheduler makes it
    index = KVIndex()
    feeds = KVEventFeeds(index)
    try:
        feeds.sync([WorkerRecord(worker_id="p", role="prefill", address="127.0.0.1:1",
                                 host="h", epoch=1, fingerprint="f", block_size=BS,
                                 kv_events_address=f"127.0.0.1:{relay.port}")])

        def batch(*events: object) -> KVEventBatch:
            return KVEventBatch(ts=time.time(), events=list(events))

        stored = BlockStored(block_hashes=[b"a" * 32, b"b" * 32], parent_block_hash=None,
                             token_ids=PROMPT[:8], block_size=BS, lora_id=None, medium="GPU",
                             lora_name=None)
        deadline = time.monotonic() + 20
        # Subscribers that join late miss earlier batches (ZeroMQ's slow joiner): each
        # try clears and stores again, so the index holds the blocks once when it sees one.
        while index.hits(["p"], PROMPT) != {"p": 8}:
            assert time.monotonic() < deadline, "no event reached the index"
            publisher.publish(batch(AllBlocksCleared(), stored))
            await asyncio.sleep(0.1)
        publisher.publish(batch(BlockRemoved(block_hashes=[b"b" * 32], medium="GPU")))
        deadline = time.monotonic() + 20
        while index.hits(["p"], PROMPT) != {"p": 4}:
            assert time.monotonic() < deadline, "the removal did not reach the index"
            await asyncio.sleep(0.05)
    finally:
        await feeds.close()
        publisher.shutdown()
        relay.close()


def test_a_taken_port_is_refused_in_words() -> None:
    relay = EventRelay("127.0.0.1")
    try:
        with pytest.raises(OSError, match="kv-events-port"):
            EventRelay("127.0.0.1", relay.port)
    finally:
        relay.close()
