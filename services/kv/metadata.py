"""What the connector's two halves tell each other every step: `PdserveConnectorMetadata`
from the scheduler half to the worker half (blocks to ship, blocks to fill), and
`LoadReports` back (vLLM's connector worker metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from services.kv.params import LoadReport


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
    lora: str = ""  # the LoRA adapter the prompt ran under ("" = the base model)
    first_block: int = 0  # the prompt block block_ids[0] holds (the ones before it stay)
    # The decode worker's receivers by rank (`SendParams.rank_addresses`): its TP size.
    kv_addresses: list[str] = field(default_factory=list)


@dataclass(slots=True)
class LoadJob:
    """Fill these local blocks from a transfer once it is complete."""

    req_id: str
    transfer_id: str
    local_block_ids: list[int]
    remote_first_block: int  # the prompt block that lands in local_block_ids[0]
    fault: str = ""
    lora: str = ""  # the LoRA adapter the request runs under: the KV's must be the same
    # The prompt block the transfer starts at, as the request's RecvParams say; a
    # transfer that starts elsewhere is refused.
    transfer_first_block: int = 0
    reused_tokens: int = 0  # prompt tokens the engine's own prefix cache held
    prefill_tp: int = 1  # the sender's TP size: which pieces each rank here receives


@dataclass(slots=True)
class PdserveConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    cancelled_loads: list[str] = field(default_factory=list)  # req ids aborted while waiting
    # transfer ids no request will load (the engine holds their prompt already, or not
    # the prefix the transfer leaves out): the receiver drops them now
    dropped_transfers: list[str] = field(default_factory=list)


@dataclass(slots=True)
class LoadReports(KVConnectorWorkerMetadata):
    reports: list[LoadReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, LoadReports)
        return LoadReports(self.reports + other.reports)
