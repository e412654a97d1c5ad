"""What the registry knows about a worker: who it is, where, and how loaded."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load report, published with every heartbeat."""

    waiting: int = 0  # requests queued in the engine
    running: int = 0  # requests being computed
    queued_prompt_tokens: int = 0  # prompt tokens not yet prefilled
    kv_usage: float = 0.0  # share of the KV cache in use, 0..1


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    worker_id: str
    role: str  # "prefill" or "decode"
    address: str  # gRPC "host:port"
    host: str  # machine identity: pairs on one host transfer KV cheaper
    epoch: int  # restart epoch
    fingerprint: str  # KV layout digest
    kv_address: str = ""  # decode: where KV transfers are received
    kv_transport: str = ""
    metrics_port: int = 0  # Prometheus port on `host` of the address (0 = none)
    capacity: int = 64  # most running sequences (max_num_seqs)
    model: str = ""  # served model name
    max_model_len: int = 0
    vocab_size: int = 0
    dtype: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    updated: float = 0.0  # time.time() of the last heartbeat
    pid: int = 0  # the serving process, for operators (and failure drills)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        d: dict[str, Any] = json.loads(text)
        d["load"] = WorkerLoad(**d.get("load", {}))
        return cls(**d)

    @property
    def saturated(self) -> bool:
        return self.load.running + self.load.waiting >= self.capacity
