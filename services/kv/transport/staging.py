"""Receiver-side bookkeeping: the life of each inbound transfer, without any sockets.

`Staged` is one inbound transfer, `Pool` where its memory comes from, `StagingTable` all
of them; a stream's transfer is turned away as `Refused` (at the header) or
`TransferFault` (mid-way), which `stream_failure` maps to the status the stream ends with.

A transfer is RECEIVING from its accepted header until every byte of every layer has
arrived in order and verified, then COMPLETE until taken (or until its lease runs out),
or FAILED with a reason. Payload goes straight into per-layer views of one pooled slab
taken when the header is accepted; nothing is visible to `take()` before the whole
transfer checked out.
Each transfer is written by the one stream that opened it; the table lock guards state
changes only, never a payload copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.tp_layout import base_transfer_id
from services.kv.transport import checksum
from services.kv.transport.frames import DataFrame, FrameError, byte_view
from services.kv.transport.slab_pool import SlabPool
from services.kv.transport.spec import ReceivedKV, ReceiveState, TransferSpec, TransportConfig

logger = logging.getLogger(__name__)


class Pool(Protocol):
    """Where staging memory comes from: `SlabPool` (private) or `SegmentPool` (shared)."""

    def get(self, nbytes: int) -> torch.Tensor: ...

    def put(self, slab: torch.Tensor) -> None: ...

    def retire(self, slab: torch.Tensor) -> None: ...


class Refused(Exception):
    """The header was not accepted (incompatible peer, duplicate id, no room)."""


class NoStagingMemory(Refused):
    """The header was fine but its staging memory could not be had (a full device)."""


class TransferFault(Exception):
    """The transfer broke a rule mid-way; it is FAILED and the stream should stop.

    `data_loss` tells corrupt or missing bytes (checksum, truncation) from protocol
    violations, so the server can answer DATA_LOSS or INVALID_ARGUMENT.
    """

    def __init__(self, reason: str, data_loss: bool = False) -> None:
        super().__init__(reason)
        self.data_loss = data_loss


def stream_failure(e: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status a receiving stream ends with when `e` ended it (one mapping for the
    gRPC and the shared-memory paths); None for an error that is not a transfer's fault
    (the receiver's own bug)."""
    if isinstance(e, Refused):
        return grpc.StatusCode.FAILED_PRECONDITION, f"refused: {e}"
    if isinstance(e, TransferFault):
        code = grpc.StatusCode.DATA_LOSS if e.data_loss else grpc.StatusCode.INVALID_ARGUMENT
        return code, str(e)
    if isinstance(e, FrameError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {e}"
    if isinstance(e, grpc.RpcError):
        return grpc.StatusCode.CANCELLED, "stream dropped: sender gone or cancelled"
    return None


@dataclass(eq=False)
class Staged:
    """One inbound transfer. Only its owning stream writes `layers`."""

    spec: TransferSpec
    sender: PeerIdentity
    layers: list[torch.Tensor]
    views: list[memoryview | None]  # byte views of CPU layers, made on first write
    first_ts: float
    first_wall: float
    last_progress: float
    state: ReceiveState = ReceiveState.RECEIVING
    error: str | None = None
    filled: list[int] = field(default_factory=list)  # bytes received per layer
    next_chunk: list[int] = field(default_factory=list)  # expected chunk index per layer
    checksum_s: float = 0.0  # time spent verifying the checksums of what arrived
    expires: float = 0.0  # COMPLETE / FAILED records are dropped after this
    last_wall: float = 0.0
    on_stall: Callable[[], None] | None = None  # stops the stream when the reaper fails it
    slab: torch.Tensor | None = None  # pooled memory under `layers`
    checksum: str = checksum.DEFAULT  # the algorithm the sender named in its header
    pool: Pool | None = None  # where `slab` came from and goes back to
    released: bool = False  # discarded by the receiver while it was still arriving


class StagingTable:
    """All inbound transfers of one receiver; thread-safe."""

    def __init__(
        self,
        identity: PeerIdentity,
        config: TransportConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.identity = identity
        self.config = config
        self._clock = clock
        self._items: dict[str, Staged] = {}
        self._staged_bytes = 0
        self._cond = threading.Condition()
        self.pool = SlabPool(torch.device(config.device), config.pool_bytes)
        self._lent: dict[int, Pool] = {}  # data_ptr of a taken transfer's slab -> its pool
        # Discarded transfer ids -> when to forget them: a transfer released before (or
        # while) it arrives is refused, which stops its sender and frees its blocks.
        self._gone: dict[str, float] = {}

    # -- opening ---------------------------------------------------------------------
    def refusal(self, sender: PeerIdentity, spec: TransferSpec) -> str | None:
        """Why this sender may not deliver this transfer here, or None."""
        me = self.identity
        reasons = []
        diffs = me.fingerprint.differences(sender.fingerprint)
        if diffs:
            reasons.append("layout mismatch (receiver != sender): " + "; ".join(diffs))
        digest = me.fingerprint.digest()
        if spec.receiver_fingerprint != digest:
            reasons.append(
                f"sender expects receiver layout {spec.receiver_fingerprint}, "
                f"receiver {me.worker_id} has {digest}"
            )
        if spec.receiver_epoch != me.epoch:
            reasons.append(
                f"stale receiver epoch: sender expects {spec.receiver_epoch}, "
                f"receiver {me.worker_id} is at epoch {me.epoch}"
            )
        return "; ".join(reasons) or None

    def open(
        self,
        sender: PeerIdentity,
        spec: TransferSpec,
        algorithm: str,
        on_stall: Callable[[], None] | None = None,
        pool: Pool | None = None,
    ) -> Staged:
        """Accept a header and allocate its buffers; raises Refused with the reason."""
        reason = self.refusal(sender, spec)
        if reason:
            raise Refused(reason)
        if not checksum.known(algorithm):
            known = ", ".join(checksum.ALGORITHMS)
            raise Refused(f"unknown checksum algorithm {algorithm!r} (this receiver knows {known})")
        need = spec.total_nbytes
        with self._cond:
            if self._is_gone(spec.transfer_id):
                raise Refused(self._released(spec.transfer_id))
            old = self._items.get(spec.transfer_id)
            if old is not None and old.state is not ReceiveState.FAILED:
                raise Refused(f"transfer {spec.transfer_id} is already {old.state.value}")
            if self._staged_bytes + need > self.config.max_staged_bytes:
                raise Refused(
                    f"staging full: {self._staged_bytes} + {need} bytes "
                    f"> {self.config.max_staged_bytes}"
                )
            self._staged_bytes += need
        pool = pool or self.pool
        try:
            slab = pool.get(need)
            step = spec.layer_nbytes
            layers = [
                slab[i * step : (i + 1) * step].view(spec.dtype).view(spec.layer_shape)
                for i in range(spec.num_layers)
            ]
        except (RuntimeError, ValueError, OSError) as e:  # out of memory, bad device
            with self._cond:
                self._staged_bytes -= need
            raise NoStagingMemory(f"cannot allocate {need} staging bytes: {e}") from None
        now = self._clock()
        st = Staged(spec, sender, layers, [None] * spec.num_layers, now, time.time(), now)
        st.slab, st.pool = slab, pool
        st.filled = [0] * spec.num_layers
        st.next_chunk = [0] * spec.num_layers
        st.on_stall = on_stall
        st.checksum = algorithm
        with self._cond:
            # Released while its buffers were being made (the lock was not held): a
            # record made now would wait out its lease in staging.
            released = self._is_gone(spec.transfer_id)
            if released:
                self._staged_bytes -= need
            else:
                if spec.transfer_id in self._items:  # a FAILED record of an earlier try
                    self._drop(self._items.pop(spec.transfer_id))
                self._items[spec.transfer_id] = st
        if released:
            pool.put(slab)  # never handed to a writer: safe to reuse
            raise Refused(self._released(spec.transfer_id))
        return st

    def _is_gone(self, transfer_id: str) -> bool:
        """Released: the transfer, or the one it is a piece of (caller holds the lock)."""
        return transfer_id in self._gone or base_transfer_id(transfer_id) in self._gone

    @staticmethod
    def _released(transfer_id: str) -> str:
        return (f"transfer {transfer_id} was released by the receiver (its request was "
                "cancelled or moved)")

    # -- writing ---------------------------------------------------------------------
    def check_live(self, st: Staged) -> None:
        """Raise unless `st` still takes bytes: Refused if the receiver released it (the
        sender is told so, as it would be had it arrived later), else TransferFault."""
        if st.released:
            raise Refused(self._released(st.spec.transfer_id))
        if st.state is not ReceiveState.RECEIVING:
            raise TransferFault(st.error or f"transfer is {st.state.value}")

    def write_chunk(self, st: Staged, frame: DataFrame) -> None:
        """Verify one gRPC data chunk and copy it into place; raises TransferFault."""
        self.check_live(st)
        spec, layer = st.spec, frame.layer
        if layer >= spec.num_layers:
            raise TransferFault(f"layer {layer} out of range (transfer has {spec.num_layers})")
        expected = st.next_chunk[layer]
        if frame.chunk != expected:
            what = "duplicate" if frame.chunk < expected else "out-of-order"
            raise TransferFault(
                f"{what} chunk {frame.chunk} of layer {layer} (expected chunk {expected})"
            )
        if frame.offset != st.filled[layer]:
            raise TransferFault(
                f"chunk {frame.chunk} of layer {layer} at offset {frame.offset}, "
                f"expected offset {st.filled[layer]}"
            )
        if frame.nbytes == 0 or frame.offset + frame.nbytes > spec.layer_nbytes:
            raise TransferFault(
                f"chunk {frame.chunk} of layer {layer} has wrong size: {frame.nbytes} bytes at "
                f"offset {frame.offset}, layer holds {spec.layer_nbytes}"
            )
        t0 = time.perf_counter()
        intact = checksum.digest(st.checksum, frame.payload) == frame.checksum
        st.checksum_s += time.perf_counter() - t0
        if not intact:
            raise TransferFault(
                f"checksum mismatch in chunk {frame.chunk} of layer {layer}", data_loss=True
            )
        views, layers = st.views, st.layers  # a concurrent fail() swaps these lists out
        if not layers:
            raise TransferFault(st.error or "transfer was dropped")
        view = views[layer]
        if view is None:
            view = views[layer] = byte_view(layers[layer])
        view[frame.offset : frame.offset + frame.nbytes] = frame.payload
        st.filled[layer] += frame.nbytes
        st.next_chunk[layer] += 1
        st.last_progress = self._clock()

    def layer_buffer(self, st: Staged, layer: int, nbytes: int) -> torch.Tensor:
        """The buffer a whole layer is received into (torch transport); checks the size."""
        self.check_live(st)
        spec = st.spec
        if not 0 <= layer < spec.num_layers:
            raise TransferFault(f"layer {layer} out of range (transfer has {spec.num_layers})")
        if st.next_chunk[layer]:  # claimed by an earlier LAYER frame
            raise TransferFault(f"duplicate layer {layer}")
        if nbytes != spec.layer_nbytes:
            raise TransferFault(
                f"layer {layer} announced with wrong size: {nbytes} bytes, "
                f"spec says {spec.layer_nbytes}"
            )
        layers = st.layers
        if not layers:
            raise TransferFault(st.error or "transfer was dropped")
        st.next_chunk[layer] = 1
        st.last_progress = self._clock()
        return layers[layer]

    def layer_received(self, st: Staged, layer: int, checksum_s: float) -> None:
        """A whole layer arrived and verified, its checksum taking `checksum_s` seconds
        (torch and shared-memory transports)."""
        st.filled[layer] = st.spec.layer_nbytes
        st.checksum_s += checksum_s
        st.last_progress = self._clock()

    def finish(self, st: Staged, num_chunks: int, nbytes: int) -> int:
        """The sender says it is done: COMPLETE if everything is here, else TransferFault."""
        self.check_live(st)
        spec, got = st.spec, sum(st.filled)
        missing = [i for i, n in enumerate(st.filled) if n != spec.layer_nbytes]
        if missing:
            raise TransferFault(
                f"truncated: end after {got} of {spec.total_nbytes} bytes "
                f"({len(missing)} incomplete layers, first {missing[0]})",
                data_loss=True,
            )
        if nbytes != got or num_chunks != sum(st.next_chunk):
            raise TransferFault(
                f"end frame counts {num_chunks} chunks / {nbytes} bytes, "
                f"received {sum(st.next_chunk)} chunks / {got} bytes"
            )
        with self._cond:
            self.check_live(st)
            st.state = ReceiveState.COMPLETE
            st.views = []
            st.last_wall = time.time()
            st.last_progress = self._clock()
            st.expires = st.last_progress + self.config.lease_s
            self._cond.notify_all()
        return got

    def fail(self, st: Staged | None, reason: str) -> None:
        """Mark a transfer FAILED (first reason wins) and free its buffers."""
        if st is None:
            return
        with self._cond:
            if st.state is not ReceiveState.RECEIVING:
                return
            st.state, st.error = ReceiveState.FAILED, reason
            self._release(st)
            st.expires = self._clock() + self.config.lease_s
            self._cond.notify_all()
        logger.warning(
            "KV transfer %s from %s failed: %s", st.spec.transfer_id, st.sender.worker_id, reason
        )

    # -- reading ---------------------------------------------------------------------
    def state(self, transfer_id: str) -> ReceiveState:
        with self._cond:
            st = self._items.get(transfer_id)
            return ReceiveState.UNKNOWN if st is None else st.state

    def error(self, transfer_id: str) -> str | None:
        with self._cond:
            st = self._items.get(transfer_id)
            return None if st is None else st.error

    def take(self, transfer_id: str) -> ReceivedKV | None:
        with self._cond:
            st = self._items.get(transfer_id)
            if st is None or st.state is not ReceiveState.COMPLETE:
                return None
            del self._items[transfer_id]
            self._staged_bytes -= st.spec.total_nbytes
            if st.slab is not None and st.pool is not None:
                self._lent[st.slab.data_ptr()] = st.pool
        return ReceivedKV(
            spec=st.spec,
            layers=st.layers,
            nbytes=st.spec.total_nbytes,
            first_byte_ts=st.first_ts,
            last_byte_ts=st.last_progress,
            first_byte_wall=st.first_wall,
            last_byte_wall=st.last_wall,
            chunks=sum(st.next_chunk),
            checksum_s=st.checksum_s,
            sender_worker_id=st.sender.worker_id,
            storage=st.slab,
        )

    def release(self, kv: ReceivedKV) -> None:
        """Return a taken transfer's slab to the pool (its layers become invalid)."""
        if kv.storage is not None:
            with self._cond:
                pool = self._lent.pop(kv.storage.data_ptr(), self.pool)
            pool.put(kv.storage)
        kv.layers, kv.storage = [], None

    def discard(self, transfer_id: str) -> None:
        """Drop a transfer nobody will take, in any state, now, with its pieces; for one
        lease its id (and its pieces') is refused, so a sender that has not started yet (or
        still sends) is turned away."""
        with self._cond:
            self._gone[transfer_id] = self._clock() + self.config.lease_s
            # A transfer's pieces (between tensor-parallel layouts) go with it.
            ids = [t for t in self._items
                   if t == transfer_id or base_transfer_id(t) == transfer_id]
            for tid in ids:
                st = self._items.pop(tid)
                if st.state is ReceiveState.COMPLETE and st.slab is not None and st.pool:
                    st.pool.put(st.slab)  # its writer is done: safe to reuse
                    st.slab = None
                if st.state is ReceiveState.RECEIVING:
                    st.state, st.error = ReceiveState.FAILED, self._released(tid)
                    st.released = True
                self._drop(st)
            if ids:
                self._cond.notify_all()

    def wait(self, transfer_id: str, timeout: float) -> ReceiveState:
        """Block until the transfer is COMPLETE or FAILED (or timeout); for tests and tools."""
        deadline = self._clock() + timeout
        with self._cond:
            while True:
                st = self._items.get(transfer_id)
                state = ReceiveState.UNKNOWN if st is None else st.state
                left = deadline - self._clock()
                if state in (ReceiveState.COMPLETE, ReceiveState.FAILED) or left <= 0:
                    return state
                self._cond.wait(left)

    @property
    def staged_bytes(self) -> int:
        with self._cond:
            return self._staged_bytes

    def staged(self) -> tuple[int, int]:
        """(transfers, bytes) held now: receiving, or received and not yet taken (a
        failed transfer's record holds no memory and is not counted)."""
        with self._cond:
            held = sum(st.state is not ReceiveState.FAILED for st in self._items.values())
            return held, self._staged_bytes

    # -- housekeeping ----------------------------------------------------------------
    def sweep(self) -> float:
        """Fail stalled transfers, drop expired ones; returns seconds until the next due."""
        now, cfg = self._clock(), self.config
        stalled: list[Staged] = []
        next_due = min(cfg.stall_timeout_s, cfg.lease_s)
        with self._cond:
            for tid, until in list(self._gone.items()):
                if now >= until:
                    del self._gone[tid]
            for tid, st in list(self._items.items()):
                if st.state is ReceiveState.RECEIVING:
                    idle = now - st.last_progress
                    if idle >= cfg.stall_timeout_s:
                        stalled.append(st)
                    else:
                        next_due = min(next_due, cfg.stall_timeout_s - idle)
                elif now >= st.expires:
                    if st.state is ReceiveState.COMPLETE:
                        if st.slab is not None and st.pool:  # writer done: reuse it
                            st.pool.put(st.slab)
                            st.slab = None
                        logger.warning(
                            "KV transfer %s not taken within %.1fs lease; dropped", tid, cfg.lease_s
                        )
                    self._drop(self._items.pop(tid))
                else:
                    next_due = min(next_due, st.expires - now)
        for st in stalled:
            self.fail(st, f"stalled: no data for {cfg.stall_timeout_s:.1f}s")
            if st.on_stall is not None:
                st.on_stall()
        return max(next_due, 0.01)

    def clear(self) -> None:
        with self._cond:
            for st in self._items.values():
                if st.state is ReceiveState.RECEIVING:
                    st.state, st.error = ReceiveState.FAILED, "receiver closed"
                self._drop(st)
            self._items.clear()
            self._cond.notify_all()

    def _release(self, st: Staged) -> None:
        """Forget a transfer's buffers (caller holds the lock). A failed transfer's slab is
        not pooled: its stream may still be writing into it."""
        if st.layers:
            self._staged_bytes -= st.spec.total_nbytes
            if st.slab is not None and st.pool is not None:
                st.pool.retire(st.slab)
            st.layers, st.views, st.slab = [], [], None

    def _drop(self, st: Staged) -> None:
        self._release(st)
