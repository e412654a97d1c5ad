"""The connector's worker half on a prefill engine: ship each layer's blocks as the layer
is computed, and tell vLLM when a request's blocks may be freed.

Transport choice: a job whose receiver shares this host (`SaveJob.same_host`) goes through
shared memory when shm is on here, else over the receiver's network transport. Every
same-host transfer that ends up on the network is counted by reason (`fallbacks`, exported
as `pdserve_kv_transport_fallbacks_total{reason}`) and each (peer, reason) is logged once:
a silent fallback to TCP costs up to 100x on a GPU node. So is every transfer a nixl
sender hands to gRPC (its reasons: "receiver_refuses_nixl", "nixl_staging_full"; the
nixl sender logs each (peer, reason) once)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.metadata import PdserveConnectorMetadata, SaveJob
from services.kv.params import FAULT_CORRUPT_CHUNK
from services.kv.reshard import CPU_HEAD_AXIS, take
from services.kv.tp_layout import (
    KVPiece,
    kv_heads_per_rank,
    kv_pieces,
    piece_transfer_id,
    sends_of,
)
from services.kv.transport import (
    SHM,
    KVSender,
    TransferSpec,
    TransportConfig,
    make_sender,
    make_shm_sender,
)
from services.kv.transport.nixl_sender import NixlKVSender
from services.kv.transport.shm_sender import ShmKVSender
from services.kv.transport.slab_pool import SlabPool

REASON_DISABLED = "shm_disabled"  # this worker's `shm` key is false

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sending:
    """One transfer in flight: a job's blocks, or one piece of them (some of its heads,
    for one decode rank) where the two workers' tensor-parallel layouts differ."""

    job: SaveJob
    started: float  # time.monotonic()
    kind: str  # the sender it went to: a network kind, or "shm:<network kind>"
    piece: KVPiece
    address: str  # the decode rank's receiver
    whole: bool  # the piece is every head of this rank's tensor (no slicing)
    layers_sent: int = 0
    slab: torch.Tensor | None = None  # pooled memory under `copies` (CPU caches)
    # Per layer, filled as computed: in the sender's own memory where it lends some
    # (`KVSender.layer_memory`: NIXL's registered arena), else in `slab`.
    copies: list[torch.Tensor] = field(default_factory=list)


class Producer:
    """The worker half of one prefill rank. At tensor-parallel size `tp` it holds the
    heads `tp_layout.rank_heads(rank, tp, ...)` and ships, for each job, the pieces
    `tp_layout.sends_of(rank, ...)` to the decode ranks that hold those heads, each piece
    its own transfer (`tp_layout.piece_transfer_id`). vLLM frees a request's blocks once
    every rank reported it finished sending."""

    def __init__(
        self,
        identity: PeerIdentity,
        config: TransportConfig,
        lease_s: float,
        allow_faults: bool,
        shm: bool = True,
        rank: int = 0,
        tp: int = 1,
    ) -> None:
        self.identity = identity
        self.config = config
        self.lease_s = lease_s
        self.allow_faults = allow_faults
        self.shm = shm
        self.rank, self.tp = rank, tp
        self.fallbacks: Counter[str] = Counter()  # same-host transfers sent over the network
        self._no_shm: dict[str, str] = {}  # peer -> why shm failed there (then: network)
        self._logged: set[tuple[str, str]] = set()
        self._senders: dict[str, KVSender] = {}  # one per transport kind, made on first use
        self._layer_index: dict[str, int] = {}
        self._block_ids: dict[str, torch.Tensor] = {}  # job's transfer id -> index tensor
        self._sending: dict[str, _Sending] = {}  # piece's transfer id -> state
        self._pieces: dict[str, list[str]] = {}  # job's transfer id -> its pieces' ids
        self._owned: set[str] = set()  # req ids with a transfer not yet reported to vLLM
        self._done: set[str] = set()  # req ids whose transfer is over (acked, failed, expired)
        self._finished: set[str] = set()  # req ids vLLM has finished (from finished_req_ids)
        # Each transfer's private copy of its blocks lives in one reused slab (CPU caches;
        # CUDA's caching allocator already reuses memory): copies of varying sizes made
        # per request and freed at its ack let the engine's RSS creep up in steps.
        self._pool = SlabPool(torch.device("cpu"), config.pool_bytes)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def _sender(self, kind: str) -> KVSender:
        if kind not in self._senders:
            if kind.startswith(f"{SHM}:"):
                network = self._sender(kind.split(":", 1)[1])
                self._senders[kind] = make_shm_sender(self.identity, self.config, network)
            else:
                self._senders[kind] = make_sender(kind, self.identity, self.config)
        return self._senders[kind]

    def _route(self, job: SaveJob, address: str = "") -> str:
        """The sender a job's transfer to `address` (a decode rank's; by default the
        job's first) goes to."""
        address = address or job.kv_address
        if not job.same_host:
            return job.kv_transport
        reason = REASON_DISABLED if not self.shm else self._no_shm.get(address)
        if reason is None:
            return f"{SHM}:{job.kv_transport}"
        self._fell_back(address, reason, "")
        return job.kv_transport

    def _fell_back(self, peer: str, reason: str, detail: str) -> None:
        self.fallbacks[reason] += 1
        if (peer, reason) not in self._logged:
            self._logged.add((peer, reason))
            log.warning(
                "KV to same-host receiver %s goes over the network (%s)%s; counted in "
                "pdserve_kv_transport_fallbacks_total",
                peer,
                reason,
                f": {detail}" if detail else "",
            )

    def take_fallbacks(self) -> dict[str, int]:
        """Fallback counts since the previous call (for vLLM's connector stats)."""
        counts, self.fallbacks = dict(self.fallbacks), Counter()
        return counts

    # -- inside the forward pass --------------------------------------------------------
    def save_kv_layer(
        self, meta: PdserveConnectorMetadata, layer_name: str, kv_layer: torch.Tensor
    ) -> None:
        idx = self._layer_index.get(layer_name)
        if idx is None or not meta.saves:
            return
        for job in meta.saves:
            try:
                self._save_layer(job, idx, kv_layer)
            except Exception:  # never take the engine down
                log.exception("KV transfer %s: layer %d not shipped", job.transfer_id, idx)
                self._give_up(job)

    def _give_up(self, job: SaveJob) -> None:
        """Abandon a job's transfers; its blocks are freed once vLLM has finished the
        request."""
        for tid in self._pieces.pop(job.transfer_id, []):
            sending = self._sending.pop(tid, None)
            if sending is not None:
                self._sender(sending.kind).cancel(tid)
                self._recycle(sending)
        self._block_ids.pop(job.transfer_id, None)
        self._owned.add(job.req_id)
        self._done.add(job.req_id)

    def _save_layer(self, job: SaveJob, idx: int, kv_layer: torch.Tensor) -> None:
        if job.req_id in self._done:
            return  # given up on earlier in this step (or nothing to send from here)
        if job.transfer_id not in self._pieces:
            self._begin_job(job, kv_layer)
            if job.req_id in self._done:
                return
        ids = self._block_ids[job.transfer_id]
        for tid in self._pieces[job.transfer_id]:
            sending = self._sending.get(tid)
            if sending is None:
                continue  # over already (refused at once)
            # A private copy of this layer's blocks (cheap beside the layer's compute),
            # of the piece's heads only; the sender's threads ship it while later layers
            # compute.
            source = kv_layer if sending.whole else take(kv_layer, sending.piece)
            if sending.copies:
                blocks = torch.index_select(source, 0, ids, out=sending.copies[idx])
            else:
                blocks = source.index_select(0, ids)
            self._sender(sending.kind).send_layer(tid, idx, blocks)
            sending.layers_sent += 1
            if sending.layers_sent == len(self._layer_index):
                self._sender(sending.kind).end(tid)

    def _begin_job(self, job: SaveJob, kv_layer: torch.Tensor) -> None:
        """Start this rank's transfers of a job: one per piece it sends."""
        addresses = job.kv_addresses or [job.kv_address]
        total_heads = self.identity.fingerprint.num_kv_heads
        pieces = kv_pieces(self.tp, len(addresses), total_heads)
        mine = sends_of(self.rank, pieces)
        self._owned.add(job.req_id)
        self._pieces[job.transfer_id] = []
        if not mine:  # another rank holds (the chosen replicas of) every head
            self._done.add(job.req_id)
            return
        held = kv_heads_per_rank(self.tp, total_heads)
        partial = any(p.src.start or p.src.count != held for p in mine)
        if partial and (kv_layer.device.type != "cpu"
                        or kv_layer.shape[CPU_HEAD_AXIS] != held):
            raise RuntimeError(
                f"this rank's KV tensor {tuple(kv_layer.shape)} does not hold its {held} KV "
                f"heads on axis {CPU_HEAD_AXIS}: KV between tensor-parallel layouts is "
                "sliced as vLLM's CPU cache lays it out")
        self._block_ids[job.transfer_id] = torch.tensor(
            job.block_ids, dtype=torch.long, device=kv_layer.device)
        for piece in mine:
            tid = piece_transfer_id(job.transfer_id, piece, pieces)
            self._pieces[job.transfer_id].append(tid)
            self._begin(job, tid, piece, addresses[piece.dst.rank], kv_layer, held)

    def _begin(self, job: SaveJob, tid: str, piece: KVPiece, address: str,
               kv_layer: torch.Tensor, held: int) -> None:
        whole = piece.src.start == 0 and piece.src.count == held
        sliced = len(job.kv_addresses) > 1 or self.tp > 1
        spec = TransferSpec(
            transfer_id=tid,
            num_layers=len(self._layer_index),
            layer_shape=(len(job.block_ids), *kv_layer.shape[1:]) if whole else (
                len(job.block_ids), piece.src.count, *kv_layer.shape[2:]),
            dtype=kv_layer.dtype,
            num_tokens=job.num_tokens,
            receiver_epoch=job.decode_epoch,
            receiver_fingerprint=job.decode_fingerprint,
            lora=job.lora,
            first_block=job.first_block,
            head_start=piece.head_start if sliced else 0,
            head_stop=piece.head_stop if sliced else 0,
        )
        sending = _Sending(job, time.monotonic(), self._route(job, address), piece, address,
                           whole)
        self._sending[tid] = sending
        sender = self._sender(sending.kind)
        sender.begin(address, spec)
        # Copies made in memory the sender lends are shipped from there without another
        # copy (NIXL WRITEs straight from its registered arena).
        memory = sender.layer_memory(tid)
        if memory is None or memory.device != kv_layer.device:
            memory = None
            if kv_layer.device.type == "cpu":
                memory = sending.slab = self._pool.get(spec.total_nbytes)
        if memory is not None:
            step = spec.layer_nbytes
            sending.copies = [
                memory[i * step : (i + 1) * step].view(spec.dtype).view(spec.layer_shape)
                for i in range(spec.num_layers)
            ]
        if job.fault == FAULT_CORRUPT_CHUNK and self.allow_faults:
            sender.corrupt_after_checksum(tid)

    # -- after each step ---------------------------------------------------------------
    def _over(self, tid: str) -> _Sending | None:
        """A piece's transfer is over: forget it; its job is over with its last piece."""
        sending = self._sending.pop(tid, None)
        if sending is None:
            return None
        self._recycle(sending)
        job = sending.job
        left = self._pieces.get(job.transfer_id)
        if left is not None and tid in left:
            left.remove(tid)
            if not left:
                del self._pieces[job.transfer_id]
                self._block_ids.pop(job.transfer_id, None)
                self._done.add(job.req_id)
        return sending

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        self._finished |= finished_req_ids & self._owned
        for sender in list(self._senders.values()):
            if isinstance(sender, ShmKVSender):
                for peer, reason, detail in sender.poll_fallbacks():
                    self._no_shm[peer] = reason  # later transfers there go straight out
                    self._fell_back(peer, reason, detail)
            elif isinstance(sender, NixlKVSender):  # logged once there; counted here
                for _, reason, _ in sender.poll_fallbacks():
                    self.fallbacks[reason] += 1
        for sender in list(self._senders.values()):
            for outcome in sender.poll_finished():
                if self._over(outcome.transfer_id) is not None and not outcome.ok:
                    log.warning("KV transfer %s failed: %s", outcome.transfer_id, outcome.error)
        now = time.monotonic()
        for tid, sending in list(self._sending.items()):
            if now - sending.started > self.lease_s:
                log.warning(
                    "KV transfer %s: lease of %.0f s ran out; freeing its blocks", tid, self.lease_s
                )
                self._sender(sending.kind).cancel(tid)
                self._over(tid)
        # Report only ids vLLM has already finished: reporting one earlier kills the
        # engine (it asserts the request is finished before freeing its blocks).
        ready = self._done & self._finished
        self._done -= ready
        self._finished -= ready
        self._owned -= ready
        return ready

    def _recycle(self, sending: _Sending) -> None:
        """The transfer is over: its copies go back to the pool (or stay with the sender
        that lent their memory). A sender thread that is still reading a failed
        transfer's copy only ever reads it, and what it reads no longer matters."""
        sending.copies = []
        if sending.slab is not None:
            slab, sending.slab = sending.slab, None
            self._pool.put(slab)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
