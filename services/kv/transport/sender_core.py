"""The part every sender shares: the transfer registry, argument checks, the bounded
layer queue, and exactly-once outcomes.

A transport subclasses `SenderCore` and implements four hooks (`_start`, `_enqueue`,
`_abort`, `_close_transport`). The helpers its worker threads may call are public and
documented here (`complete`, `fail`, `forget`, `release_item`); nothing outside this
class touches its lock or registry.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.transport.base import KVSender
from services.kv.transport.spec import TransferOutcome, TransferSpec, TransportConfig

logger = logging.getLogger(__name__)


class PeerQueue:
    """The queue slots of one receiver: `send_queue_depth` layers handed over by the
    engine and not yet taken by the network. `stuck` is set when a transfer found no slot
    within `send_block_s`, and cleared when the receiver takes a layer again."""

    __slots__ = ("slots", "stuck")

    def __init__(self, depth: int) -> None:
        self.slots = threading.Semaphore(depth)
        self.stuck = False

    def release(self) -> None:
        self.stuck = False
        self.slots.release()


@dataclass(frozen=True, slots=True, eq=False)
class LayerItem:
    """One layer handed over by the engine; holds one slot of its receiver's queue until
    released."""

    layer: int
    tensor: torch.Tensor
    event: torch.cuda.Event | None  # CUDA producers: orders readers after index_select
    queue: PeerQueue | None = None


END_ITEM: Literal["end"] = "end"  # queued after the last layer
STOP_ITEM: Literal["stop"] = "stop"  # wakes a worker thread of a transfer that is over
HEADER_ITEM: Literal["header"] = "header"  # transports that queue the header themselves
Item = LayerItem | Literal["end", "stop", "header"]

L = TypeVar("L")  # the transport's per-transfer link (a call, a pair, a segment)


@dataclass(eq=False)
class Outgoing(Generic[L]):
    """Sender-side state of one transfer, shared by the transports."""

    peer: str
    spec: TransferSpec
    sent: set[int] = field(default_factory=set)  # layers handed over by the engine
    done: bool = False  # outcome recorded; workers drop what is left
    error: str | None = None
    last_progress: float = field(default_factory=time.monotonic)
    phase: str = "starting"  # what it waits for, for stall messages
    corrupt: bool = False  # fault injection: damage the next payload after its checksum
    link: L | None = None  # the transport's handle for this transfer, set by `_start`


class SenderCore(KVSender, Generic[L]):
    """Base of the transports' senders. Thread-safe; never raises into the engine."""

    def __init__(self, identity: PeerIdentity, config: TransportConfig) -> None:
        self.identity, self.config = identity, config
        self._lock = threading.Lock()
        self._done_cond = threading.Condition(self._lock)
        self._active: dict[str, Outgoing[L]] = {}
        self._finished: list[TransferOutcome] = []
        # One slot per queued layer, per receiver: bounds the memory held by layers the
        # engine handed over but the network has not taken yet, and keeps a receiver that
        # takes nothing from holding up transfers to the others.
        self._queues: dict[str, PeerQueue] = {}
        self._closed = False

    # -- hooks a transport implements ------------------------------------------------------
    @abstractmethod
    def _start(self, out: Outgoing[L]) -> None:
        """Begin shipping `out` (must not block); sets `out.link`."""

    @abstractmethod
    def _enqueue(self, out: Outgoing[L], item: Item) -> None:
        """Queue a LayerItem or END_ITEM for `out`; called under the registry lock, so it
        must only hand the item over (never block, never call back into this class)."""

    @abstractmethod
    def _abort(self, out: Outgoing[L]) -> None:
        """Stop shipping `out`, whose failed outcome is already recorded."""

    @abstractmethod
    def _close_transport(self) -> None:
        """Release channels, groups and threads."""

    # -- helpers for the transport's threads -----------------------------------------------
    def complete(self, out: Outgoing[L], ok: bool, error: str | None, nbytes: int) -> bool:
        """Record the outcome of `out` once; returns False if it was already recorded."""
        with self._lock:
            if out.done:
                return False
            out.done, out.error = True, None if ok else error
            if self._active.get(out.spec.transfer_id) is out:
                del self._active[out.spec.transfer_id]
            tid = out.spec.transfer_id
            self._finished.append(TransferOutcome(tid, ok, out.error, nbytes))
            self._done_cond.notify_all()
        if not ok:
            logger.warning("KV transfer %s to %s failed: %s", tid, out.peer, error)
        return True

    def fail(self, out: Outgoing[L], reason: str) -> None:
        """Fail `out` (first reason wins) and stop shipping it."""
        if self.complete(out, False, reason, 0):
            self._abort(out)

    def forget(self, out: Outgoing[L]) -> None:
        """Drop `out` without an outcome: another sender took it over and reports it."""
        with self._lock:
            out.done = True
            if self._active.get(out.spec.transfer_id) is out:
                del self._active[out.spec.transfer_id]

    def release_item(self, item: Item | None) -> None:
        """Give back the queue slot a layer item holds (whoever dequeues it calls this)."""
        if isinstance(item, LayerItem) and item.queue is not None:
            item.queue.release()

    # -- KVSender --------------------------------------------------------------------------
    def begin(self, peer_address: str, spec: TransferSpec) -> None:
        out: Outgoing[L] = Outgoing(peer_address, spec)
        with self._lock:
            if spec.transfer_id in self._active:
                logger.error("KV transfer %s begun twice; ignoring the second", spec.transfer_id)
                return
            self._active[spec.transfer_id] = out
            closed = self._closed
        if closed:
            self.complete(out, False, "sender is closed", 0)
            return
        self._start(out)

    def send_layer(self, transfer_id: str, layer_idx: int, tensor: torch.Tensor) -> None:
        out = self._get(transfer_id)
        if out is None:
            return
        problem = self._layer_problem(out, layer_idx, tensor)
        if problem:
            self.fail(out, problem)
            return
        queue = self._queue(out.peer)
        # This runs in the engine's forward pass: never wait long for a receiver that
        # takes nothing, and not at all once it was found stuck.
        if not queue.slots.acquire(timeout=0 if queue.stuck else self.config.send_block_s):
            queue.stuck = True
            self.fail(out, f"receiver {out.peer} has {self.config.send_queue_depth} layers "
                      f"queued and took none in {self.config.send_block_s:g}s; not waiting "
                      "longer, which would stall the engine")
            return
        event = None
        if tensor.is_cuda:  # orders the sender thread after the producer's stream
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            if out.done:
                queue.release()
                return
            out.sent.add(layer_idx)
            self._enqueue(out, LayerItem(layer_idx, tensor, event, queue))

    def end(self, transfer_id: str) -> None:
        out = self._get(transfer_id)
        if out is None:
            return
        if len(out.sent) != out.spec.num_layers:
            self.fail(out, f"end() after {len(out.sent)} of {out.spec.num_layers} layers")
            return
        with self._lock:
            if not out.done:
                self._enqueue(out, END_ITEM)

    def cancel(self, transfer_id: str) -> None:
        out = self._get(transfer_id)
        if out is not None:
            self.fail(out, "cancelled by sender")

    def corrupt_after_checksum(self, transfer_id: str) -> None:
        out = self._get(transfer_id)
        if out is not None:
            out.corrupt = True

    def poll_finished(self, wait_s: float = 0.0) -> list[TransferOutcome]:
        """Outcomes since the last call; with `wait_s`, waits that long for the first one."""
        with self._done_cond:
            if not self._finished and wait_s > 0:
                self._done_cond.wait_for(lambda: bool(self._finished), wait_s)
            done, self._finished = self._finished, []
        return done

    def close(self) -> None:
        with self._lock:
            self._closed = True
            active = list(self._active.values())
        for out in active:
            self.fail(out, "sender closed")
        self._close_transport()

    # -- internals -------------------------------------------------------------------------
    def _queue(self, peer: str) -> PeerQueue:
        with self._lock:
            queue = self._queues.get(peer)
            if queue is None:
                queue = self._queues[peer] = PeerQueue(self.config.send_queue_depth)
            return queue

    def _get(self, transfer_id: str) -> Outgoing[L] | None:
        with self._lock:
            out = self._active.get(transfer_id)
        if out is None:
            logger.debug("KV transfer %s is unknown or finished; call ignored", transfer_id)
        return out

    @staticmethod
    def _layer_problem(out: Outgoing[L], idx: int, tensor: torch.Tensor) -> str | None:
        spec = out.spec
        if not 0 <= idx < spec.num_layers:
            return f"layer {idx} out of range (transfer has {spec.num_layers})"
        if idx in out.sent:
            return f"layer {idx} handed over twice"
        if tuple(tensor.shape) != spec.layer_shape or tensor.dtype != spec.dtype:
            return (
                f"layer {idx} is {tuple(tensor.shape)} {tensor.dtype}, "
                f"spec says {spec.layer_shape} {spec.dtype}"
            )
        return None
