"""The KV transport interface: how KV layers move from a prefill worker to a decode worker.

Roles (mirroring the two halves of the vLLM connector):

* `KVSender` lives in the prefill worker process. The connector calls `begin()`, then
  `send_layer()` once per layer from inside the forward pass, then `end()`. `send_layer`
  only queues the (private) tensor; background threads ship it, so the transfer overlaps
  the compute of later layers. Every begun transfer yields exactly one `TransferOutcome`
  from `poll_finished()`: ok only when the receiver acknowledged every byte.
* `KVReceiver` lives in the decode worker process and runs its own server. It stages
  incoming layers in private buffers; the connector polls `state()` and calls `take()`
  once the transfer is COMPLETE, then copies the blocks into its paged cache.

Neither side raises into the engine on bad input or peer faults: a fault turns the
transfer FAILED with a reason (`TransferOutcome.error`, `KVReceiver.error()`), is logged,
and the rest keeps working. A transfer is never exposed partially.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from services.kv.fingerprint import PeerIdentity

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """What one transfer carries; the receiver checks every frame against it."""

    transfer_id: str  # caller's key, unique among live transfers at the receiver
    num_layers: int
    layer_shape: tuple[int, ...]  # shape of each layer tensor, e.g. (blocks, heads, bs, 2*hs)
    dtype: torch.dtype
    num_tokens: int  # tokens whose KV the blocks hold (informational for the receiver)
    receiver_epoch: int  # epoch of the receiver the sender expects; a stale one is refused
    receiver_fingerprint: str  # layout digest the sender expects the receiver to have

    def __post_init__(self) -> None:
        if not self.transfer_id or len(self.transfer_id) > 256:
            raise ValueError("transfer_id must be 1..256 characters")
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        if not self.layer_shape or any(d <= 0 for d in self.layer_shape):
            raise ValueError(f"layer_shape must have positive dims, got {self.layer_shape}")
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {self.num_tokens}")

    @property
    def layer_nbytes(self) -> int:
        return math.prod(self.layer_shape) * self.dtype.itemsize

    @property
    def total_nbytes(self) -> int:
        return self.layer_nbytes * self.num_layers


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """Sender-side result of one transfer, reported once by `KVSender.poll_finished()`."""

    transfer_id: str
    ok: bool  # True only if the receiver acknowledged all bytes
    error: str | None  # why it failed (refusal reason, peer fault, cancel, ...)
    nbytes: int  # payload bytes the receiver acknowledged (0 unless ok)
    first_send_ts: float  # time.monotonic() when the first frame was sent
    last_ack_ts: float  # time.monotonic() when the outcome was known


@dataclass(slots=True)
class ReceivedKV:
    """A complete transfer handed over by `KVReceiver.take()`; the caller owns the tensors."""

    spec: TransferSpec
    layers: list[torch.Tensor]  # one tensor per layer, shape spec.layer_shape, spec.dtype
    nbytes: int
    first_byte_ts: float  # time.monotonic() when the header arrived
    last_byte_ts: float  # time.monotonic() when the last payload byte was verified
    first_byte_wall: float = 0.0  # the same two instants as time.time(), for cross-host logs
    last_byte_wall: float = 0.0
    sender_worker_id: str = ""
    sender_epoch: int = 0
    storage: torch.Tensor | None = None  # the staging slab `layers` view; see release()


class ReceiveState(enum.Enum):
    UNKNOWN = "unknown"  # never seen, taken, discarded, or expired
    RECEIVING = "receiving"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """Tunables shared by both ends; the defaults suit one host or a LAN."""

    chunk_bytes: int = 1 << 20  # payload bytes per gRPC data frame
    max_message_bytes: int = 8 << 20  # gRPC max send/receive message, set on both ends
    lease_s: float = 30.0  # complete-but-untaken transfers are dropped after this
    stall_timeout_s: float = 10.0  # a transfer with no progress for this long -> FAILED
    send_queue_depth: int = 64  # layers queued at the sender before send_layer blocks
    max_streams: int = 32  # concurrent inbound streams (transfers + torch pairs) served
    max_staged_bytes: int = 8 << 30  # receiver refuses new transfers beyond this staging
    device: str = "cpu"  # where the receiver stages layers ("cuda:N" for the NCCL path)
    pool_bytes: int = 1 << 30  # staging memory kept for reuse: fresh pages cost page faults

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        if self.max_message_bytes < self.chunk_bytes + 4096:
            raise ValueError("max_message_bytes must exceed chunk_bytes plus frame headers")
        if self.lease_s <= 0 or self.stall_timeout_s <= 0:
            raise ValueError("lease_s and stall_timeout_s must be positive")
        if self.send_queue_depth <= 0 or self.max_streams <= 0:
            raise ValueError("send_queue_depth and max_streams must be positive")


class KVSender(ABC):
    """Ships transfers to receivers. One per process; thread-safe; never raises on faults."""

    @abstractmethod
    def begin(self, peer_address: str, spec: TransferSpec) -> None:
        """Start a transfer to the receiver at "host:port"; returns at once."""

    @abstractmethod
    def send_layer(self, transfer_id: str, layer_idx: int, tensor: torch.Tensor) -> None:
        """Queue one layer (a private tensor the sender may keep); returns at once.

        Blocks only while `send_queue_depth` layers are already queued (backpressure),
        and never longer than `stall_timeout_s`: then the transfer fails instead.
        """

    @abstractmethod
    def end(self, transfer_id: str) -> None:
        """All layers have been handed over; the receiver acks once it has them all."""

    @abstractmethod
    def cancel(self, transfer_id: str) -> None:
        """Abandon a transfer; the receiver drops it; its outcome is ok=False."""

    @abstractmethod
    def poll_finished(self) -> list[TransferOutcome]:
        """Outcomes known since the previous call, each transfer exactly once."""

    def corrupt_after_checksum(self, transfer_id: str) -> None:
        """Fault injection for tests and drills: flip one payload byte of this transfer
        after its checksum was computed, so the receiver must catch it."""
        raise NotImplementedError(f"{type(self).__name__} cannot inject faults")

    @abstractmethod
    def close(self) -> None:
        """Fail what is still in flight, stop threads, close channels."""


class KVReceiver(ABC):
    """Serves incoming transfers and stages them until taken. One per process."""

    address: str  # "host:port" actually bound

    @abstractmethod
    def state(self, transfer_id: str) -> ReceiveState:
        """Where a transfer stands."""

    @abstractmethod
    def error(self, transfer_id: str) -> str | None:
        """Why a FAILED transfer failed (None otherwise)."""

    @abstractmethod
    def take(self, transfer_id: str) -> ReceivedKV | None:
        """Return a COMPLETE transfer and forget it; None in any other state."""

    @abstractmethod
    def discard(self, transfer_id: str) -> None:
        """Drop a transfer in any state (a RECEIVING one fails and stops being staged)."""

    def release(self, kv: ReceivedKV) -> None:
        """Give a taken transfer's memory back for reuse, once its layers were copied out.

        Optional (unreleased memory is simply freed), but reused staging memory is already
        paged in, which makes receiving markedly cheaper. `kv.layers` must not be used
        afterwards: the next transfer may overwrite them.
        """
        kv.layers, kv.storage = [], None

    @abstractmethod
    def close(self) -> None:
        """Stop serving and free staged memory."""


END_ITEM = "end"  # queued after the last layer
STOP_ITEM = "stop"  # wakes a worker thread of a transfer that is over


@dataclass(eq=False)
class Outgoing:
    """Sender-side state of one transfer, shared by the transports."""

    peer: str
    spec: TransferSpec
    sent: set[int] = field(default_factory=set)  # layers handed over by the engine
    done: bool = False  # outcome recorded; workers drop what is left
    error: str | None = None
    first_send_ts: float = 0.0
    last_progress: float = field(default_factory=time.monotonic)
    phase: str = "starting"  # what it waits for, for stall messages
    corrupt: bool = False  # fault injection: damage the next payload after its checksum
    queue: Any = None  # transport-specific work queue
    call: Any = None  # transport-specific handle (gRPC future, torch pair)


class SenderCore(KVSender):
    """What every sender shares: the transfer registry, argument checks, the bounded
    queue, and exactly-once outcomes. Transports implement the four hooks."""

    def __init__(self, identity: PeerIdentity, config: TransportConfig) -> None:
        self.identity, self.config = identity, config
        self._lock = threading.Lock()
        self._done_cond = threading.Condition(self._lock)
        self._active: dict[str, Outgoing] = {}
        self._finished: list[TransferOutcome] = []
        # One slot per queued layer across all transfers: bounds the memory held by layers
        # the engine handed over but the network has not taken yet.
        self._slots = threading.Semaphore(config.send_queue_depth)
        self._closed = False

    @abstractmethod
    def _start(self, out: Outgoing) -> None:
        """Begin shipping `out` (must not block)."""

    @abstractmethod
    def _enqueue(self, out: Outgoing, item: Any) -> None:
        """Queue a (layer_idx, tensor, cuda_event) tuple or END_ITEM; called under the lock."""

    @abstractmethod
    def _abort(self, out: Outgoing) -> None:
        """Stop shipping `out`, whose failed outcome is already recorded."""

    @abstractmethod
    def _close_transport(self) -> None:
        """Release channels, groups and threads."""

    def begin(self, peer_address: str, spec: TransferSpec) -> None:
        out = Outgoing(peer_address, spec)
        with self._lock:
            if spec.transfer_id in self._active:
                logger.error("KV transfer %s begun twice; ignoring the second", spec.transfer_id)
                return
            self._active[spec.transfer_id] = out
            closed = self._closed
        if closed:
            self._complete(out, False, "sender is closed", 0)
            return
        self._start(out)

    def send_layer(self, transfer_id: str, layer_idx: int, tensor: torch.Tensor) -> None:
        out = self._get(transfer_id)
        if out is None:
            return
        problem = self._layer_problem(out, layer_idx, tensor)
        if problem:
            self._fail(out, problem)
            return
        if not self._slots.acquire(timeout=self.config.stall_timeout_s):
            self._fail(out, f"send queue full for {self.config.stall_timeout_s:.1f}s")
            return
        event = None
        if tensor.is_cuda:  # orders the sender thread after the producer's stream
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            if out.done:
                self._slots.release()
                return
            out.sent.add(layer_idx)
            self._enqueue(out, (layer_idx, tensor, event))

    def end(self, transfer_id: str) -> None:
        out = self._get(transfer_id)
        if out is None:
            return
        if len(out.sent) != out.spec.num_layers:
            self._fail(out, f"end() after {len(out.sent)} of {out.spec.num_layers} layers")
            return
        with self._lock:
            if not out.done:
                self._enqueue(out, END_ITEM)

    def cancel(self, transfer_id: str) -> None:
        out = self._get(transfer_id)
        if out is not None:
            self._fail(out, "cancelled by sender")

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
            self._fail(out, "sender closed")
        self._close_transport()

    # -- shared helpers ------------------------------------------------------------------
    def _get(self, transfer_id: str) -> Outgoing | None:
        with self._lock:
            out = self._active.get(transfer_id)
        if out is None:
            logger.debug("KV transfer %s is unknown or finished; call ignored", transfer_id)
        return out

    @staticmethod
    def _layer_problem(out: Outgoing, idx: int, tensor: torch.Tensor) -> str | None:
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

    def _fail(self, out: Outgoing, reason: str) -> None:
        if self._complete(out, False, reason, 0):
            self._abort(out)

    def _complete(self, out: Outgoing, ok: bool, error: str | None, nbytes: int) -> bool:
        """Record the outcome once; returns False if it was already recorded."""
        now = time.monotonic()
        with self._lock:
            if out.done:
                return False
            out.done, out.error = True, None if ok else error
            if self._active.get(out.spec.transfer_id) is out:
                del self._active[out.spec.transfer_id]
            tid = out.spec.transfer_id
            outcome = TransferOutcome(tid, ok, out.error, nbytes, out.first_send_ts or now, now)
            self._finished.append(outcome)
            self._done_cond.notify_all()
        if not ok:
            logger.warning("KV transfer %s to %s failed: %s", tid, out.peer, error)
        return True

    def _release_item(self, item: Any) -> None:
        """Give back the queue slot a layer item holds (whoever dequeues it calls this)."""
        if isinstance(item, tuple):
            self._slots.release()
