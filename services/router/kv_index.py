"""The precise prefix index: which prompt blocks each engine holds, as the engines
themselves report it through vLLM's KV cache events (block stored, block removed, all
blocks cleared), from every prefill and decode worker that publishes them.

It lives in this router's memory; each router replica subscribes to every worker
itself, with a `WatchKVEvents` stream on the channel it routes requests on. vLLM's own
block hashes are seeded per process, so they cannot be compared across engines or with
a prompt the router holds: every stored block is indexed under pdserve's chained hash
(`prefix.chain_hash`) of its tokens and its parent's hash, at the engine's own block
size, and a prompt is hashed at each worker's block size to look it up. A worker's view
is dropped whole when it cannot be trusted any more: all blocks cleared, a new epoch (a
restart), a gap in the event sequence (events lost), a stream that ended (events missed
until the next one), or the worker leaving the view. After that the index knows only
what the engine stores next, so it may miss blocks the engine still holds, never claim
blocks it does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import msgspec
from prometheus_client import Counter as MetricCounter

from pdserve.v1 import worker_pb2 as wpb
from services.registry.records import WorkerRecord
from services.router.prefix import block_digests, chain_hash, chain_root

if TYPE_CHECKING:
    from services.router.orchestrator import Peer

log = logging.getLogger(__name__)

# A prompt is looked up this many blocks deep at most: longer shared prefixes are
# counted up to there (the hashing is per request, on the routing path).
MAX_LOOKUP_BLOCKS = 1024
# Events of these media are indexed: the engine's own KV cache ("GPU" even on a CPU
# engine). Blocks copied to an offloading tier are another medium, with their own
# stored and removed events, and are not what the engine computes from directly.
INDEXED_MEDIA = (None, "GPU")
# After a worker's events stream ends, the wait before the next one: doubled after each
# stream in a row that brought nothing (the worker is down or restarting), up to the max.
RESUBSCRIBE_MIN_S = 0.2
RESUBSCRIBE_MAX_S = 5.0

EVENTS = MetricCounter("pdserve_router_kv_events", "KV cache events this router applied to "
                       "its prefix index, by kind (stored, removed, cleared)", ["kind"])
RESETS = MetricCounter("pdserve_router_kv_index_resets", "times a worker's view in the "
                       "precise prefix index was dropped, by why (cleared: the engine cleared "
                       "its cache; gap: events were lost; restart: a new epoch; gone: the "
                       "worker left the view; undecodable: a message was not an event batch; "
                       "resubscribed: the events stream ended, events were missed until the "
                       "next; no_events: the worker said it serves none)", ["reason"])
UNCHAINED = MetricCounter("pdserve_router_kv_blocks_unchained", "stored blocks left out "
                          "of the prefix index because their parent block is unknown to it "
                          "(stored before this router subscribed, or dropped with a reset)")


# vLLM's event wire format (`vllm.distributed.kv_events`), mirrored here: importing
# vLLM takes seconds, which the router's event loop would stall for, and the router
# never needs vLLM otherwise. Fields vLLM adds later are ignored; an event kind it
# adds makes the batch undecodable, which drops the worker's view (never a wrong one).
# A unit test decodes what vLLM's own classes encode.
BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class WorkerBlocks:
    """One engine's cached blocks as the index knows them."""

    block_size: int
    # vLLM's block hash -> (pdserve's chained hash, times stored and not removed)
    names: dict[Any, tuple[bytes, int]] = field(default_factory=dict)
    held: Counter[bytes] = field(default_factory=Counter)  # chained hash -> blocks held
    seq: int = -1  # the last event batch applied (-1: none yet)

    def store(self, vllm_hash: Any, ours: bytes) -> None:
        _, refs = self.names.get(vllm_hash, (ours, 0))
        self.names[vllm_hash] = (ours, refs + 1)
        self.held[ours] += 1

    def remove(self, vllm_hash: Any) -> None:
        entry = self.names.get(vllm_hash)
        if entry is None:  # stored before this router subscribed
            return
        ours, refs = entry
        if refs > 1:
            self.names[vllm_hash] = (ours, refs - 1)
        else:
            del self.names[vllm_hash]
        self.held[ours] -= 1
        if self.held[ours] <= 0:
            del self.held[ours]

    def clear(self) -> None:
        self.names.clear()
        self.held.clear()


class KVIndex:
    """Cached blocks per worker, fed by event batches (`apply`); pure logic, no sockets."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerBlocks] = {}

    def track(self, worker_id: str, block_size: int) -> None:
        """Start following a worker (its view empty until it stores blocks)."""
        self._workers[worker_id] = WorkerBlocks(block_size)

    def forget(self, worker_id: str, reason: str = "gone") -> None:
        if self._workers.pop(worker_id, None) is not None:
            RESETS.labels(reason).inc()

    def tracking(self, worker_id: str) -> bool:
        """Whether this worker's blocks come from its events (else: the approximate index)."""
        return worker_id in self._workers

    def blocks(self, worker_id: str) -> int:
        """How many distinct blocks the worker is known to hold."""
        w = self._workers.get(worker_id)
        return len(w.held) if w is not None else 0

    def reset(self, worker_id: str, reason: str) -> None:
        """Drop what is known of the worker's cache, keep following it."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        w.clear()
        # Nothing held is left to protect: the next batch starts a new sequence (after a
        # resubscription it does not follow the last one seen).
        w.seq = -1
        RESETS.labels(reason).inc()
        log.info("prefix index: worker %s's cached blocks dropped (%s)", worker_id, reason)

    def apply(self, worker_id: str, seq: int, events: Iterable[Any]) -> None:
        """One event batch (vLLM's `KVEventBatch.events`) numbered `seq` by the engine's
        publisher. A batch that does not follow the last one means batches were lost:
        the worker's view is dropped rather than trusted."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        if w.seq >= 0 and seq != w.seq + 1:
            self.reset(worker_id, "gap")
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(w, event)
                EVENTS.labels("stored").inc()
            elif kind == "BlockRemoved":
                if event.medium in INDEXED_MEDIA and not event.group_idx:
                    for h in event.block_hashes:
                        w.remove(h)
                EVENTS.labels("removed").inc()
            elif kind == "AllBlocksCleared":
                self.reset(worker_id, "cleared")
                EVENTS.labels("cleared").inc()
        w.seq = seq

    @staticmethod
    def _stored(w: WorkerBlocks, event: Any) -> None:
        # group_idx > 0: another KV cache group of a hybrid model (sliding window,
        # mamba), whose blocks are not the prompt's plain attention blocks.
        if event.medium not in INDEXED_MEDIA or event.group_idx:
            return
        size = int(event.block_size)
        if not w.block_size:
            w.block_size = size  # an older record that did not report it
        if size != w.block_size:
            return  # not the size prompts are hashed at for this worker
        if event.parent_block_hash is None:
            parent = chain_root(event.lora_name or "")
        else:
            known = w.names.get(event.parent_block_hash)
            if known is None:
                UNCHAINED.inc(len(event.block_hashes))
                return
            parent = known[0]
        tokens = event.token_ids
        for i, vllm_hash in enumerate(event.block_hashes):
            block = tokens[i * size:(i + 1) * size]
            if len(block) < size:  # full blocks only, as vLLM caches them
                return
            parent = chain_hash(parent, block)
            w.store(vllm_hash, parent)

    def hits(self, worker_ids: Iterable[str], token_ids: Sequence[int],
             lora: str = "") -> dict[str, int]:
        """Cached prompt tokens per tracked worker (untracked ones are left out): the
        leading full blocks of the prompt that the worker holds, hashed once per block
        size."""
        digests: dict[int, list[bytes]] = {}
        out: dict[str, int] = {}
        for worker_id in worker_ids:
            w = self._workers.get(worker_id)
            if w is None:
                continue
            if not w.held or not w.block_size:
                out[worker_id] = 0
                continue
            hashes = digests.get(w.block_size)
            if hashes is None:
                hashes = digests[w.block_size] = block_digests(
                    token_ids, w.block_size, MAX_LOOKUP_BLOCKS, lora)
            n = 0
            for h in hashes:
                if h not in w.held:
                    break
                n += 1
            out[worker_id] = n * w.block_size
        return out


class KVEventFeeds:
    """One `WatchKVEvents` stream per worker whose record says it serves its KV events,
    on the channel `peer_of` gives for the worker (the router's, with its credentials),
    each feeding `index`. `sync` follows the view: a new worker is subscribed to, one
    that left is dropped, one with a new epoch (restarted) or a new address starts
    afresh. A stream that ends is opened again after a short backoff, the worker's view
    dropped first: events published meanwhile are lost."""

    def __init__(self, index: KVIndex, peer_of: Callable[[WorkerRecord], Peer]) -> None:
        self.index = index
        self._peer_of = peer_of
        self._feeds: dict[str, tuple[tuple[int, str], asyncio.Task[None]]] = {}
        self._ending: set[asyncio.Task[None]] = set()  # cancelled, not yet done
        # Workers whose stream is open (the worker sent its headers: it has subscribed),
        # with the task that opened it.
        self._open: dict[str, asyncio.Task[Any]] = {}

    def sync(self, view: Sequence[WorkerRecord]) -> None:
        wanted = {w.worker_id: w for w in view if w.kv_events}
        for worker_id, (key, task) in list(self._feeds.items()):
            w = wanted.get(worker_id)
            if w is not None and (w.epoch, w.address) == key:
                continue
            task.cancel()
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
            del self._feeds[worker_id]
            self.index.forget(worker_id, "gone" if w is None else "restart")
        for worker_id, w in wanted.items():
            if worker_id in self._feeds:
                continue
            self.index.track(worker_id, w.block_size)
            task = asyncio.get_running_loop().create_task(
                self._follow(worker_id, self._peer_of(w)))
            self._feeds[worker_id] = ((w.epoch, w.address), task)

    @property
    def workers(self) -> list[str]:
        """The workers whose events are followed (a worker that said it serves none is
        left out until its record changes)."""
        return sorted(w for w, (_, task) in self._feeds.items() if not task.done())

    @property
    def subscribed(self) -> list[str]:
        """The workers whose stream is open now: every batch their engines publish from
        here on reaches the index."""
        return sorted(self._open)

    async def _follow(self, worker_id: str, peer: Peer) -> None:
        backoff = RESUBSCRIBE_MIN_S
        failures = 0  # streams in a row that ended without an event
        try:
            while True:
                received, why = await self._stream(worker_id, peer)
                if why is None:
                    return  # the worker serves no events: the approximate index
                if received:
                    # The engine goes on storing and evicting while no stream is open:
                    # what the index learnt from this one can no longer be trusted.
                    self.index.reset(worker_id, "resubscribed")
                    backoff, failures = RESUBSCRIBE_MIN_S, 0
                failures += 1
                log.log(logging.INFO if failures == 1 else logging.DEBUG,
                        "KV events of %s: %s; subscribing again in %.1f s", worker_id,
                        why, backoff)
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, RESUBSCRIBE_MAX_S)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: the worker goes back to the approximate index
            log.exception("KV events of %s: the subscriber failed; the worker is routed on "
                          "the approximate prefix index until the next view refresh",
                          worker_id)
            self.index.forget(worker_id, "undecodable")
            if (entry := self._feeds.get(worker_id)) and entry[1] is asyncio.current_task():
                del self._feeds[worker_id]  # the next `sync` subscribes again

    async def _stream(self, worker_id: str, peer: Peer) -> tuple[int, str | None]:
        """Apply one stream's batches until it ends: (batches received, why it ended),
        why None when the worker serves no events."""
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        call = peer.watch_kv_events(wpb.WatchKVEventsRequest())
        received = 0
        task = asyncio.current_task()
        try:
            await call.initial_metadata()  # sent once the worker has subscribed
            if task is not None and not call.done():
                self._open[worker_id] = task
            async for message in call:
                received += 1
                try:
                    batch = decoder.decode(message.batch)
                except msgspec.DecodeError as e:
                    log.warning("KV events of %s: not an event batch (%s); its cached "
                                "blocks are dropped from the prefix index", worker_id, e)
                    self.index.reset(worker_id, "undecodable")
                    continue
                self.index.apply(worker_id, message.seq, batch.events)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.UNIMPLEMENTED):
                log.warning("KV events of %s: %s; it is routed on the approximate prefix "
                            "index", worker_id, e.details() or e.code().name)
                self.index.forget(worker_id, "no_events")
                return received, None
            return received, f"the stream ended ({e.code().name}: {e.details()})"
        finally:
            if self._open.get(worker_id) is task:  # not a newer feed's (a restart)
                del self._open[worker_id]
            call.cancel()
        return received, "the stream ended (the worker is stopping)"

    async def close(self) -> None:
        tasks = [*(task for _, task in self._feeds.values()), *self._ending]
        self._feeds.clear()
        self._open.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
