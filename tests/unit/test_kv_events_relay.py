"""The worker's KV events path without an engine: vLLM's own ZeroMQ publisher (the class
the engine runs) -> the worker's relay -> its fan-out to subscribers -> `WatchKVEvents`
on a real gRPC server on loopback (tests/helpers/kv_events.py: the workers' handler, on a
server with nothing else) -> the router's feeds and decoder -> the index. Who may call
it (mutual TLS) is tested in tests/integration/test_security_ports.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from pdserve.v1 import worker_pb2 as wpb
from services.registry.records import WorkerRecord
from services.router.kv_index import KVEventFeeds, KVIndex
from services.router.orchestrator import Peer
from services.server.channels import dial
from services.worker.kv_events import EventRelay
from tests.helpers.kv_events import events_server

BS = 4
PROMPT = list(range(200, 213))


class Vllm:
    """vLLM's publisher as its scheduler makes it, publishing to `relay`."""

    def __init__(self, relay: EventRelay) -> None:
        from vllm.distributed.kv_events import EventPublisherFactory

        config = relay.engine_config()
        assert config.endpoint.startswith("ipc://") and "*" not in config.endpoint
        self.publisher = EventPublisherFactory.create(config)

    def publish(self, *events: Any) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def stored(self, hashes: list[bytes], tokens: list[int]) -> Any:
        from vllm.distributed.kv_events import BlockStored

        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                           block_size=BS, lora_id=None, medium="GPU", lora_name=None)

    def cleared(self) -> Any:
        from vllm.distributed.kv_events import AllBlocksCleared

        return AllBlocksCleared()

    def removed(self, hashes: list[bytes]) -> Any:
        from vllm.distributed.kv_events import BlockRemoved

        return BlockRemoved(block_hashes=hashes, medium="GPU")


def record(port: int, epoch: int = 1, kv_events: bool = True) -> WorkerRecord:
    return WorkerRecord(worker_id="p", role="prefill", address=f"127.0.0.1:{port}",
                        host="h", epoch=epoch, fingerprint="f", block_size=BS,
                        kv_events=kv_events)


async def until(check: Callable[[], bool], what: str, timeout: float = 20.0,
                each: Callable[[], None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not reached in time: {what}"
        if each is not None:
            each()
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def router_feeds() -> AsyncIterator[tuple[KVIndex, KVEventFeeds]]:
    """The router's index and feeds, on channels dialled as the router dials workers."""
    channels: dict[str, grpc.aio.Channel] = {}

    def peer_of(w: WorkerRecord) -> Peer:
        channel = channels.setdefault(w.address, dial(w.address, None))
        return Peer(w.worker_id, channel)

    index = KVIndex()
    feeds = KVEventFeeds(index, peer_of)
    try:
        yield index, feeds
    finally:
        await feeds.close()
        for channel in channels.values():
            await channel.close()


A, B = b"a" * 32, b"b" * 32


async def test_vllms_publisher_reaches_the_router_through_the_workers_grpc_port() -> None:
    relay = EventRelay()
    vllm = Vllm(relay)
    try:
        async with events_server(relay) as port, router_feeds() as (index, feeds):
            feeds.sync([record(port)])
            assert index.tracking("p") and feeds.workers == ["p"]
            await until(lambda: feeds.subscribed == ["p"] and relay.subscribers == 1,
                        "the stream open")
            # Batches published before the relay hears the engine, or before the stream
            # is open, are not seen: each try clears and stores again.
            await until(lambda: index.hits(["p"], PROMPT) == {"p": 8}, "stored blocks",
                        each=lambda: vllm.publish(vllm.cleared(),
                                                  vllm.stored([A, B], PROMPT[:8])))
            vllm.publish(vllm.removed([B]))
            await until(lambda: index.hits(["p"], PROMPT) == {"p": 4}, "the removal")
            feeds.sync([record(port, epoch=2)])  # restarted: a new epoch, a new view
            assert index.hits(["p"], PROMPT) == {"p": 0} and index.tracking("p")
            feeds.sync([])  # gone from the view
            assert not index.tracking("p") and feeds.workers == []
    finally:
        vllm.publisher.shutdown()
        relay.close()


async def test_a_stream_that_ends_is_opened_again_and_the_view_reset_first() -> None:
    """The worker's server goes away under the stream (as a worker that stops does) and
    comes back on the same port: what the index held is dropped, since events were
    missed meanwhile, and the events after the new stream opened are indexed."""
    relay = EventRelay()
    vllm = Vllm(relay)
    try:
        async with router_feeds() as (index, feeds):
            async with events_server(relay) as port:
                feeds.sync([record(port)])
                await until(lambda: index.hits(["p"], PROMPT) == {"p": 8}, "stored blocks",
                            each=lambda: vllm.publish(vllm.cleared(),
                                                      vllm.stored([A, B], PROMPT[:8])))
            await until(lambda: index.blocks("p") == 0, "the view reset")
            assert index.tracking("p") and feeds.workers == ["p"] and feeds.subscribed == []
            async with events_server(relay, port):
                await until(lambda: feeds.subscribed == ["p"], "subscribed again")
                vllm.publish(vllm.stored([A], PROMPT[:4]))
                await until(lambda: index.hits(["p"], PROMPT) == {"p": 4},
                            "events on the new stream")
    finally:
        vllm.publisher.shutdown()
        relay.close()


async def test_a_worker_without_events_says_so_and_is_left_to_the_approximate_index() -> None:
    async with events_server(None) as port:
        async with dial(f"127.0.0.1:{port}", None) as channel:
            call = Peer("p", channel).watch_kv_events(wpb.WatchKVEventsRequest())
            assert await call.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--no-kv-events" in await call.details()
        async with router_feeds() as (index, feeds):
            feeds.sync([record(port)])
            await until(lambda: not index.tracking("p"), "the worker forgotten")
            assert feeds.workers == []
            feeds.sync([record(port)])  # the same record: not asked again
            assert feeds.workers == [] and not index.tracking("p")


async def test_a_slow_subscriber_is_dropped_without_holding_up_the_others() -> None:
    """One subscriber reads as batches come, the other nothing: the relay thread never
    waits for the slow one, which is ended once it holds its bound, while the fast one
    gets every batch, in order."""
    relay = EventRelay(max_pending_bytes=16384)
    vllm = Vllm(relay)
    loop = asyncio.get_running_loop()
    try:
        probe = relay.subscribe(loop)
        await until(lambda: not probe._queue.empty(), "the relay hears vLLM",
                    each=lambda: vllm.publish(vllm.cleared()))
        relay.unsubscribe(probe)
        fast, slow = relay.subscribe(loop), relay.subscribe(loop)
        batches = 400  # each a few hundred bytes: far beyond the slow one's bound

        async def read_all() -> list[int]:
            seqs: list[int] = []
            while len(seqs) < batches:
                item = await asyncio.wait_for(fast.next(), 20)
                assert item is not None, "the fast subscriber was ended"
                seqs.append(item[0])
            return seqs

        reader = asyncio.create_task(read_all())
        for i in range(batches):
            vllm.publish(vllm.stored([i.to_bytes(32, "big")], list(range(i, i + 32))))
            if i % 10 == 9:  # in bursts, as an engine's steps publish them
                await asyncio.sleep(0.01)
        seqs = await reader
        assert seqs == list(range(seqs[0], seqs[0] + batches))  # in order, none lost
        assert relay.subscribers == 1 and slow.dropped and not fast.ended
        held = 0
        while await asyncio.wait_for(slow.next(), 5) is not None:
            held += 1
        assert 0 < held < batches  # what it held when dropped, then the end
    finally:
        vllm.publisher.shutdown()
        relay.close()


async def test_a_dropped_subscribers_stream_ends_aborted() -> None:
    relay = EventRelay(max_pending_bytes=4096)
    vllm = Vllm(relay)
    try:
        async with events_server(relay) as port, dial(f"127.0.0.1:{port}", None) as channel:
            call = Peer("p", channel).watch_kv_events(wpb.WatchKVEventsRequest())
            await until(lambda: relay.subscribers == 1, "subscribed")
            # Unread, the stream's flow-control window fills, then the relay's bound.
            payload = list(range(4096))
            await until(lambda: relay.subscribers == 0, "the subscriber dropped",
                        each=lambda: vllm.publish(vllm.stored([A], payload)))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.ABORTED
            assert "call again" in (e.value.details() or "")
    finally:
        vllm.publisher.shutdown()
        relay.close()


async def test_closing_the_relay_ends_every_stream() -> None:
    """A stopping worker closes its relay: streams end (its drain is not held by them),
    and a later subscriber ends at once."""
    relay = EventRelay()
    loop = asyncio.get_running_loop()
    sub = relay.subscribe(loop)
    await asyncio.to_thread(relay.close)
    assert await asyncio.wait_for(sub.next(), 5) is None and not sub.dropped
    late = relay.subscribe(loop)
    assert await asyncio.wait_for(late.next(), 5) is None
