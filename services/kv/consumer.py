"""The connector's worker half on a decode engine: receive transfers, copy whole blocks
into the paged KV cache, and tell vLLM which requests may run (or must recompute).

A transfer may start at a later prompt block than the first (`TransferSpec.first_block`:
the blocks before it were left out, the engine holding them in its prefix cache). The
load job says which block the request expects it to start at, from the request's own
`RecvParams`; a transfer that starts elsewhere is refused, never loaded shifted."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.metadata import LoadJob, LoadReports, PdserveConnectorMetadata
from services.kv.params import FAULT_NOISE_KV, LoadReport
from services.kv.reshard import CPU_HEAD_AXIS
from services.kv.tp_layout import (
    KVPiece,
    kv_heads_per_rank,
    kv_pieces,
    piece_transfer_id,
    receives_of,
)
from services.kv.transport import ReceivedKV, ReceiveState, TransportConfig, make_receiver

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Waiting:
    job: LoadJob
    since: float  # time.monotonic() when the load job arrived
    # The pieces this rank still waits for, by their transfer ids (one, the job's own id,
    # where both workers run at TP=1), and whether pieces are sliced by heads at all.
    left: dict[str, KVPiece] = field(default_factory=dict)
    sliced: bool = False
    report: LoadReport | None = None  # what the pieces copied in so far add up to


class Consumer:
    """The worker half of one decode rank. At tensor-parallel size `tp` it holds the
    heads `tp_layout.rank_heads(rank, tp, ...)`, serves its own receiver, and loads a
    request once every piece `tp_layout.receives_of(rank, ...)` arrived and was copied
    into its heads; vLLM lets the request run once every rank reported it."""

    def __init__(
        self,
        identity: PeerIdentity,
        config: TransportConfig,
        kind: str,
        host: str,
        port: int,
        load_timeout_s: float,
        unknown_grace_s: float,
        allow_faults: bool,
        rank: int = 0,
        tp: int = 1,
    ) -> None:
        self.receiver = make_receiver(kind, identity, config, host, port)
        self.total_heads = identity.fingerprint.num_kv_heads
        self.rank, self.tp = rank, tp
        self.load_timeout_s = load_timeout_s
        self.unknown_grace_s = unknown_grace_s
        self.allow_faults = allow_faults
        self._caches: list[torch.Tensor] = []
        self._waiting: dict[str, _Waiting] = {}  # req id -> load job
        self._recved: set[str] = set()  # finished receiving (ok or failed), to report
        self._failed: set[str] = set()
        self._reports: list[LoadReport] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = list(kv_caches.values())

    def _expect(self, job: LoadJob, now: float) -> _Waiting:
        """The pieces of `job` this rank waits for."""
        waiting = _Waiting(job, now)
        try:
            pieces = kv_pieces(job.prefill_tp, self.tp, self.total_heads)
        except ValueError as e:  # a sender whose TP size no model shape allows
            waiting.report = LoadReport(job.req_id, job.transfer_id, ok=False,
                                        error=f"prefill TP {job.prefill_tp}: {e}")
            return waiting
        waiting.sliced = len(pieces) > 1
        waiting.left = {piece_transfer_id(job.transfer_id, p, pieces): p
                        for p in receives_of(self.rank, pieces)}
        return waiting

    def start_load_kv(self, meta: PdserveConnectorMetadata) -> None:
        now = time.monotonic()
        for job in meta.loads:
            self._waiting[job.req_id] = self._expect(job, now)
        for tid in meta.dropped_transfers:  # no request will load it: free its staging
            self.receiver.discard(tid)
        for rid in meta.cancelled_loads:
            waiting = self._waiting.pop(rid, None)
            if waiting is not None:
                self.receiver.discard(waiting.job.transfer_id)
                self._recved.add(rid)  # releases the blocks vLLM kept for it
        for rid, waiting in list(self._waiting.items()):
            self._poll(rid, waiting, now)

    def _poll(self, rid: str, waiting: _Waiting, now: float) -> None:
        job = waiting.job
        if not waiting.left:  # refused before any piece was looked for
            self._fail(rid, waiting, "")
            return
        age = now - waiting.since
        for tid, piece in list(waiting.left.items()):
            state = self.receiver.state(tid)
            if state is ReceiveState.COMPLETE:
                kv = self.receiver.take(tid)
                if kv is None:
                    continue
                del waiting.left[tid]
                report = self._apply(job, piece, waiting.sliced, kv)
                waiting.report = (report if waiting.report is None
                                  else waiting.report.merged(report))
                if not report.ok:
                    self._fail(rid, waiting, "")
                    return
            elif state is ReceiveState.FAILED:
                self._fail(rid, waiting, self.receiver.error(tid) or "transfer failed", tid)
                return
            elif state is ReceiveState.UNKNOWN and age > self.unknown_grace_s:
                self._fail(rid, waiting, "unknown or expired transfer handle", tid)
                return
        if not waiting.left:
            assert waiting.report is not None
            self._finish(rid, waiting.report)
        elif age > self.load_timeout_s:
            self._fail(rid, waiting, f"no complete KV after {self.load_timeout_s:.0f} s",
                       next(iter(waiting.left)))

    def _fail(self, rid: str, waiting: _Waiting, error: str, tid: str = "") -> None:
        """The load cannot complete: drop what is still staged or arriving of any of its
        pieces, and report it failed (with what was copied in before)."""
        job = waiting.job
        self.receiver.discard(job.transfer_id)  # with every piece of it
        if error and tid != job.transfer_id and tid:
            error = f"{tid}: {error}"
        failure = LoadReport(rid, job.transfer_id, ok=False, error=error)
        report = failure if waiting.report is None else waiting.report.merged(failure)
        self._finish(rid, report)

    def _apply(self, job: LoadJob, piece: KVPiece, sliced: bool, kv: ReceivedKV
               ) -> LoadReport:
        try:
            error = self._copy_in(job, kv, piece, sliced)
        finally:
            self.receiver.release(kv)
        shipped = kv.spec.layer_shape[0]
        return LoadReport(
            job.req_id,
            job.transfer_id,
            ok=not error,
            nbytes=kv.nbytes,
            first_byte_wall=kv.first_byte_wall,
            last_byte_wall=kv.last_byte_wall,
            chunks=kv.chunks,
            checksum_s=kv.checksum_s,
            error=error,
            reused_tokens=job.reused_tokens,
            # every block is the same size: the left-out ones as the shipped ones
            prompt_nbytes=kv.nbytes // shipped * (kv.spec.first_block + shipped),
        )

    def _copy_in(self, job: LoadJob, kv: ReceivedKV, piece: KVPiece | None = None,
                 sliced: bool = False) -> str:
        """Copy the job's blocks of one piece (None: the whole transfer of a TP=1 pair)
        into the paged cache, at the piece's heads; why not, or "" once done."""
        if kv.spec.lora != job.lora:  # KV of one adapter never serves another's request
            return (f"the KV was computed with LoRA adapter {kv.spec.lora or '(none)'!r}, "
                    f"the request runs under {job.lora or '(none)'!r}")
        start = kv.spec.first_block
        if start != job.transfer_first_block:
            return (f"the transfer starts at prompt block {start}, the request expects "
                    f"block {job.transfer_first_block}: the prefill and decode sides "
                    "disagree on the blocks left out")
        heads = (kv.spec.head_start, kv.spec.head_stop)
        want = (piece.head_start, piece.head_stop) if sliced and piece else (0, 0)
        if heads != want:
            return (f"the transfer holds KV heads {heads[0]}..{heads[1] - 1}, this rank "
                    f"({self.rank} of {self.tp}) expects heads {want[0]}..{want[1] - 1} "
                    "from it" if sliced else
                    f"the transfer holds KV heads {heads[0]}..{heads[1] - 1} of a "
                    "tensor-parallel sender; this rank expects all its heads in one transfer")
        shipped = kv.spec.layer_shape[0]
        # Prompt blocks [remote_first_block, wanted) are loaded; the transfer holds
        # [start, start + shipped).
        wanted = job.remote_first_block + len(job.local_block_ids)
        if len(kv.layers) != len(self._caches) or job.remote_first_block < start or (
                start + shipped < wanted):
            return (
                f"transfer holds {len(kv.layers)} layers x prompt blocks {start}.."
                f"{start + shipped - 1}; need {len(self._caches)} x blocks "
                f"{job.remote_first_block}..{wanted - 1}"
            )
        ids = torch.tensor(job.local_block_ids, dtype=torch.long)
        first, last = job.remote_first_block - start, wanted - start
        whole = piece is None or (piece.dst.start == 0 and piece.dst.count == (
            kv_heads_per_rank(self.tp, self.total_heads)))
        for cache, layer in zip(self._caches, kv.layers, strict=True):
            # A piece of some of this rank's heads goes to their slice of the head axis
            # (vLLM's CPU layout; the producer sends such pieces only from CPU caches).
            target = cache if whole or piece is None else cache.narrow(
                CPU_HEAD_AXIS, piece.dst.start, piece.dst.count)
            if layer.shape[1:] != target.shape[1:] or layer.dtype != target.dtype:
                return (f"layer shape {tuple(layer.shape)} does not fit the cache's "
                        f"{tuple(target.shape)}")
            src = layer[first:last]
            if job.fault == FAULT_NOISE_KV and self.allow_faults:
                src = torch.randn_like(src)
            target.index_copy_(0, ids.to(cache.device), src.to(cache.device))
        return ""

    def _finish(self, rid: str, report: LoadReport) -> None:
        self._waiting.pop(rid, None)
        if not report.ok:
            log.warning("KV load for %s (%s) failed: %s", rid, report.transfer_id, report.error)
            self._failed.add(rid)
        self._recved.add(rid)
        self._reports.append(report)

    def get_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished receiving, of which failed); each id reported once."""
        recved, failed = self._recved, self._failed
        self._recved, self._failed = set(), set()
        return recved, failed

    def worker_meta(self) -> LoadReports | None:
        if not self._reports:
            return None
        reports, self._reports = self._reports, []
        return LoadReports(reports)

    def close(self) -> None:
        self.receiver.close()
