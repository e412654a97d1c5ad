"""The worker's KV cache events: vLLM's publisher inside the engine, fanned out to the
routers that watch them over the worker's gRPC port (`WatchKVEvents`).

vLLM's publisher is a ZeroMQ socket. The engine publishes on an ipc socket in a directory
only this user can enter; a relay thread in the worker process reads every message and
hands it, unchanged, to each subscriber: one per open `WatchKVEvents` call. No other
port is opened: the events leave the worker only on its gRPC port, under the mutual TLS
of its other internal calls, because they name the token ids the engine has cached.

A subscriber holds at most `max_pending_bytes` of batches not yet sent. One that falls
further behind (a stalled router, a slow link) is dropped and its stream ended, rather
than the relay thread blocking or the worker's memory growing; its router then drops
what it knows of this worker's cache and subscribes again.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from pdserve.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)

# vLLM keeps past batches for replays only when a replay endpoint is set; none is.
REPLAY_BATCHES = 1
# Batches queued for one subscriber and not yet sent; beyond, it is dropped. A subscriber
# with nothing queued always takes the next batch, however large.
MAX_PENDING_BYTES = 16 << 20
# What a queued batch costs beyond its payload (its tuple, its callback on the loop), so
# that many small batches count too.
BATCH_OVERHEAD_BYTES = 256
POLL_MS = 100  # the relay thread's wait for a message, between looks at `_closing`

NO_EVENTS = ("this worker publishes no KV cache events (its engine runs without prefix "
             "caching, or it was started with --no-kv-events): route it on the approximate "
             "prefix index, or restart it with prefix caching and KV events on")


class Subscription:
    """One subscriber's queue on its event loop. The relay thread offers batches
    (`_offer`, under the relay's lock); the loop takes them (`next`)."""

    def __init__(self, lock: threading.Lock, loop: asyncio.AbstractEventLoop,
                 max_pending_bytes: int) -> None:
        self._lock = lock
        self._loop = loop
        self._limit = max_pending_bytes
        self._queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        # Bytes handed to the loop and not yet taken, counted from the moment the relay
        # schedules them: a stalled loop's callback backlog is bounded too.
        self._pending = 0
        self.dropped = False  # ended for falling behind (else: ended by the relay's close)
        self.ended = False

    def _offer(self, seq: int, payload: bytes) -> bool:
        """Queue one batch (relay thread, lock held); False: the subscriber is too far
        behind, or its loop is gone, and must be ended."""
        size = len(payload) + BATCH_OVERHEAD_BYTES
        if self._pending and self._pending + size > self._limit:
            return False
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (seq, payload))
        except RuntimeError:  # the loop is closed: nobody is reading
            return False
        self._pending += size
        return True

    def _end(self, dropped: bool) -> None:
        """End the stream after what is queued (relay thread or loop, lock held)."""
        if self.ended:
            return
        self.ended, self.dropped = True, dropped
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is reading
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)

    async def next(self) -> tuple[int, bytes] | None:
        """The next (seq, payload) batch, or None once the subscription has ended."""
        item = await self._queue.get()
        if item is not None:
            with self._lock:
                self._pending -= len(item[1]) + BATCH_OVERHEAD_BYTES
        return item


class EventRelay:
    """Reads the engine's event messages (ipc SUB) and fans them out to subscribers."""

    def __init__(self, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        import zmq

        self.max_pending_bytes = max_pending_bytes
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-events-"))  # mode 0700
        self.ipc_path = self._dir / "events"
        self._lock = threading.Lock()
        self._subscribers: set[Subscription] = set()
        self._closing = threading.Event()
        self._close_lock = threading.Lock()
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.SUB)
        self._front.setsockopt(zmq.SUBSCRIBE, b"")
        # Connected before the engine binds: ZeroMQ reconnects until it does, so the
        # relay hears the engine's first batch.
        self._front.connect(f"ipc://{self.ipc_path}")
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kv-events-relay")
        self._thread.start()
        atexit.register(self.close)

    def engine_config(self) -> Any:
        """vLLM's KVEventsConfig publishing to this relay."""
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=f"ipc://{self.ipc_path}",
                              buffer_steps=REPLAY_BATCHES)

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> Subscription:
        """A new subscriber on `loop`, sent every batch from now on (an ended one when
        the relay is closed)."""
        sub = Subscription(self._lock, loop, self.max_pending_bytes)
        with self._lock:
            if self._closing.is_set():
                sub._end(dropped=False)
            else:
                self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subscribers.discard(sub)

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers)

    def _run(self) -> None:
        import zmq

        try:
            while not self._closing.is_set():
                if not self._front.poll(POLL_MS):
                    continue
                frames = self._front.recv_multipart()
                if len(frames) != 3:  # (topic, seq, payload), as vLLM's publisher sends
                    log.warning("KV events: a message of %d frames from the engine, not an "
                                "event batch; skipped (routers see a gap)", len(frames))
                    continue
                self._fan_out(int.from_bytes(frames[1], "big", signed=True), frames[2])
        except zmq.ZMQError:
            if not self._closing.is_set():
                log.exception("the KV events relay stopped; routers fall back to the "
                              "approximate prefix index for this worker")
        except Exception:
            log.exception("the KV events relay stopped; routers fall back to the "
                          "approximate prefix index for this worker")
        finally:
            self._front.close(linger=0)
            self._end_all()

    def _fan_out(self, seq: int, payload: bytes) -> None:
        with self._lock:
            behind = [sub for sub in self._subscribers if not sub._offer(seq, payload)]
            for sub in behind:
                self._subscribers.discard(sub)
                sub._end(dropped=True)
        if behind:
            log.warning("KV events: %d subscriber(s) more than %d bytes behind were "
                        "dropped; their routers subscribe again", len(behind),
                        self.max_pending_bytes)

    def _end_all(self) -> None:
        with self._lock:
            self._closing.set()
            for sub in self._subscribers:
                sub._end(dropped=False)
            self._subscribers.clear()

    def close(self) -> None:
        """Stop relaying: every open stream ends (a stopping worker's drain is not held
        by streams that never finish), later subscribers end at once."""
        with self._close_lock:  # from a stopping worker's thread and from atexit
            self._closing.set()
            if self._thread.is_alive() and self._thread is not threading.current_thread():
                self._thread.join(timeout=POLL_MS / 1000 + 1.0)
            self._end_all()
            if not self._thread.is_alive() and not self._ctx.closed:
                self._ctx.term()
            shutil.rmtree(self._dir, ignore_errors=True)


async def watch(relay: EventRelay | None, context: grpc.aio.ServicerContext
                ) -> AsyncIterator[wpb.WatchKVEventsResponse]:
    """`WatchKVEvents` for a worker's servicers: every batch the engine publishes from
    now on, until the worker stops or this caller falls too far behind."""
    if relay is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_EVENTS)
        return
    sub = relay.subscribe(asyncio.get_running_loop())
    try:
        # Headers now, before any batch: the caller knows from them that every batch
        # published from here on reaches it.
        await context.send_initial_metadata(())
        while (item := await sub.next()) is not None:
            yield wpb.WatchKVEventsResponse(seq=item[0], batch=item[1])
    finally:
        relay.unsubscribe(sub)
    if sub.dropped:
        await context.abort(grpc.StatusCode.ABORTED,
                            f"this subscriber fell more than {relay.max_pending_bytes} "
                            "bytes of KV events behind and was dropped: events were lost, "
                            "so drop what is known of this worker's cache and call again")
