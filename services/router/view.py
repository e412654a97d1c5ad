"""Where the router learns about workers. `Registry` (Redis, shared by every router
replica) is one source; `FixedView` is the other: a set of workers known up front and
in-memory client leases, which is what `serve --mode disagg` routes over. The router
is the same code over either."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from pdserve.v1 import worker_pb2 as wpb
from services.registry.leases import Lease
from services.registry.records import WorkerRecord


class WorkerView(Protocol):
    async def workers(self) -> list[WorkerRecord]: ...

    async def prefix_hits(self, block_hashes: Sequence[str],
                          block_size: int) -> dict[str, int]: ...

    async def record_prefix(self, worker_id: str, block_hashes: Sequence[str]) -> None: ...

    async def acquire_client_lease(self, client_id: str, limit: int) -> Lease | None: ...

    async def release_client_lease(self, lease: Lease) -> None: ...

    async def close(self) -> None: ...


def record_of(info: wpb.WorkerInfo, address: str) -> WorkerRecord:
    """A worker as its own GetWorkerInfo describes it (no load: the router's own
    in-flight counts stand in for heartbeats)."""
    role = "prefill" if info.role == wpb.WORKER_ROLE_PREFILL else "decode"
    layout = json.loads(info.fingerprint_json or "{}")
    tp = int(info.tp) or 1  # 0: a worker older than the field, which ran at TP 1
    dtype = info.dtype or layout.get("dtype", "")
    return WorkerRecord(
        worker_id=info.worker_id, role=role, address=address, host=info.host,
        epoch=int(info.epoch), fingerprint=info.fingerprint_digest,
        kv_address=info.kv_address if role == "decode" else "",
        kv_transport=info.kv_transport if role == "decode" else "",
        capacity=int(info.capacity) or 64, model=info.model,
        max_model_len=int(info.max_model_len), vocab_size=int(info.vocab_size), dtype=dtype,
        kv_addresses=tuple(info.kv_addresses) if role == "decode" else (), tp=tp,
        # the layout's KV heads are the model's; a record names each rank's
        kv_heads=max(1, int(layout.get("num_kv_heads", 0)) // tp) if layout.get(
            "num_kv_heads") else 0,
        block_size=int(layout.get("block_size", 0)),
        loras=tuple(sorted((a.name, a.path) for a in info.lora_adapters)))


class FixedView:
    """Workers fixed at start (the local pair); no prefix index (one prefill worker)."""

    def __init__(self, records: list[WorkerRecord]) -> None:
        self._records = list(records)
        self._leases: Counter[str] = Counter()

    async def workers(self) -> list[WorkerRecord]:
        return list(self._records)

    async def prefix_hits(self, block_hashes: Sequence[str], block_size: int) -> dict[str, int]:
        return {}

    async def record_prefix(self, worker_id: str, block_hashes: Sequence[str]) -> None:
        return None

    async def acquire_client_lease(self, client_id: str, limit: int) -> Lease | None:
        if self._leases[client_id] >= limit:
            return None
        self._leases[client_id] += 1
        return Lease(client_id, uuid.uuid4().hex)

    async def release_client_lease(self, lease: Lease) -> None:
        self._leases[lease.client_id] -= 1
        if self._leases[lease.client_id] <= 0:
            del self._leases[lease.client_id]

    async def close(self) -> None:
        return None
