"""What travels between the halves of the connector and the services around it.

`kv_transfer_params` is the only channel from a service to the connector's scheduler
half (it rides on the request's SamplingParams); `PdserveConnectorMetadata` goes from
the scheduler half to the worker half every step; `LoadReports` comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

KEY = "pdserve"  # our entry in kv_transfer_params
LOAD_KEY = "pdserve_load"  # the decode side's report, on its final output

# Fault injection, for tests and failure drills; workers refuse it unless enabled.
FAULT_CORRUPT_CHUNK = "corrupt_chunk"  # the sender flips bytes in one chunk after its checksum
FAULT_NOISE_KV = "noise_kv"  # the receiver overwrites the loaded blocks with noise
FAULTS = ("", FAULT_CORRUPT_CHUNK, FAULT_NOISE_KV)


def check_fault(fault: str, allowed: bool) -> None:
    """Refuse an unknown fault, and any fault on a worker that does not allow them."""
    from services.errors import InvalidRequest, PermissionDenied

    if fault not in FAULTS:
        raise InvalidRequest(f"fault: {fault!r} is not one of {FAULTS[1:]}")
    if fault and not allowed:
        raise PermissionDenied(
            "fault: fault injection is off on this worker (--allow-fault-injection)"
        )


def send_params(
    transfer_id: str,
    kv_address: str,
    kv_transport: str,
    decode_epoch: int,
    decode_fingerprint: str,
    fault: str = "",
    same_host: bool = False,
) -> dict[str, Any]:
    """kv_transfer_params of a prefill request: ship the prompt's KV there.

    `same_host`: the decode worker runs on this worker's host (the router sets it when
    the two records share `host`); the producer then ships through shared memory when
    shm is enabled, else over `kv_transport`, and counts why.
    """
    return {
        KEY: {
            "role": "send",
            "transfer_id": transfer_id,
            "kv_address": kv_address,
            "kv_transport": kv_transport,
            "decode_epoch": decode_epoch,
            "decode_fingerprint": decode_fingerprint,
            "fault": fault,
            "same_host": bool(same_host),
        }
    }


def recv_params(transfer_id: str, num_tokens: int, fault: str = "") -> dict[str, Any]:
    """kv_transfer_params of a decode request: the first `num_tokens` come by transfer."""
    return {
        KEY: {"role": "recv", "transfer_id": transfer_id, "num_tokens": num_tokens, "fault": fault}
    }


def ours(kv_transfer_params: dict[str, Any] | None, role: str) -> dict[str, Any] | None:
    entry = (kv_transfer_params or {}).get(KEY)
    return entry if isinstance(entry, dict) and entry.get("role") == role else None


@dataclass(slots=True)
class SaveJob:
    """Ship these blocks of a finished prompt, layer by layer, during this step."""

    req_id: str  # vLLM's internal id
    transfer_id: str
    kv_address: str
    kv_transport: str
    decode_epoch: int
    decode_fingerprint: str
    block_ids: list[int]
    num_tokens: int
    fault: str = ""
    same_host: bool = False  # the receiver shares this host: shared memory may be used


@dataclass(slots=True)
class LoadJob:
    """Fill these local blocks from a transfer once it is complete."""

    req_id: str
    transfer_id: str
    local_block_ids: list[int]
    remote_first_block: int  # the first shipped block that lands in local_block_ids[0]
    fault: str = ""


@dataclass(slots=True)
class PdserveConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    cancelled_loads: list[str] = field(default_factory=list)  # req ids aborted while waiting


@dataclass(slots=True)
class LoadReport:
    """How one load went, reported by the worker half to the scheduler half."""

    req_id: str
    transfer_id: str
    ok: bool
    nbytes: int = 0
    first_byte_wall: float = 0.0
    last_byte_wall: float = 0.0
    error: str = ""

    def as_params(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "bytes": self.nbytes,
            "first_byte_wall": self.first_byte_wall,
            "last_byte_wall": self.last_byte_wall,
            "error": self.error,
        }


@dataclass(slots=True)
class LoadReports(KVConnectorWorkerMetadata):
    reports: list[LoadReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, LoadReports)
        return LoadReports(self.reports + other.reports)
