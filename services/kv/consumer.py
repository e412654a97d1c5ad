"""The connector's worker half on a decode engine: receive transfers, copy whole blocks
into the paged KV cache, and tell vLLM which requests may run (or must recompute).

A transfer may start at a later prompt block than the first (`TransferSpec.first_block`:
the blocks before it were left out, the engine holding them in its prefix cache). The
load job says which block the request expects it to start at, from the request's own
`RecvParams`; a transfer that starts elsewhere is refused, never loaded shifted."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.metadata import LoadJob, LoadReports, PdserveConnectorMetadata
from services.kv.params import FAULT_NOISE_KV, LoadReport
from services.kv.transport import ReceivedKV, ReceiveState, TransportConfig, make_receiver

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Waiting:
    job: LoadJob
    since: float  # time.monotonic() when the load job arrived


class Consumer:
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
    ) -> None:
        self.receiver = make_receiver(kind, identity, config, host, port)
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

    def start_load_kv(self, meta: PdserveConnectorMetadata) -> None:
        now = time.monotonic()
        for job in meta.loads:
            self._waiting[job.req_id] = _Waiting(job, now)
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
        tid = waiting.job.transfer_id
        state = self.receiver.state(tid)
        if state is ReceiveState.COMPLETE:
            kv = self.receiver.take(tid)
            if kv is not None:
                self._finish(rid, self._apply(waiting.job, kv))
            return
        age = now - waiting.since
        if state is ReceiveState.FAILED:
            reason = self.receiver.error(tid) or "transfer failed"
            self.receiver.discard(tid)
            self._finish(rid, LoadReport(rid, tid, ok=False, error=reason))
        elif state is ReceiveState.UNKNOWN and age > self.unknown_grace_s:
            self._finish(
                rid, LoadReport(rid, tid, ok=False, error="unknown or expired transfer handle")
            )
        elif age > self.load_timeout_s:
            self.receiver.discard(tid)
            self._finish(
                rid,
                LoadReport(
                    rid, tid, ok=False, error=f"no complete KV after {self.load_timeout_s:.0f} s"
                ),
            )

    def _apply(self, job: LoadJob, kv: ReceivedKV) -> LoadReport:
        try:
            error = self._copy_in(job, kv)
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

    def _copy_in(self, job: LoadJob, kv: ReceivedKV) -> str:
        """Copy the job's blocks into the paged cache; why not, or "" once done."""
        if kv.spec.lora != job.lora:  # KV of one adapter never serves another's request
            return (f"the KV was computed with LoRA adapter {kv.spec.lora or '(none)'!r}, "
                    f"the request runs under {job.lora or '(none)'!r}")
        start = kv.spec.first_block
        if start != job.transfer_first_block:
            return (f"the transfer starts at prompt block {start}, the request expects "
                    f"block {job.transfer_first_block}: the prefill and decode sides "
                    "disagree on the blocks left out")
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
        for cache, layer in zip(self._caches, kv.layers, strict=True):
            if layer.shape[1:] != cache.shape[1:] or layer.dtype != cache.dtype:
                return f"layer shape {tuple(layer.shape)} does not fit the cache"
            src = layer[first:last]
            if job.fault == FAULT_NOISE_KV and self.allow_faults:
                src = torch.randn_like(src)
            cache.index_copy_(0, ids.to(cache.device), src.to(cache.device))
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
