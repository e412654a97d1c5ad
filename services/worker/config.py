"""Prefill and decode worker settings (CLI flags and `PDSERVE_*` variables come from
this model, see `services/settings.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.settings import ADVANCED

Role = Literal["prefill", "decode"]


class WorkerConfig(BaseSettings):
    """Prefill/decode worker settings. Env prefix PDSERVE_."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    worker_id: str = Field("", description="worker name; empty = <role>-<host>-<random>")
    kv_transport: Literal["grpc", "torch", "nixl"] = Field(
        "grpc", description="decode: how KV arrives (grpc: any host; torch: torch.distributed "
        "pair groups, gloo on CPU, NCCL on GPU; nixl: NIXL one-sided writes over UCX into "
        "memory registered once, needs the nixl package)"
    )
    kv_host: str = Field("127.0.0.1", description="decode: address the KV receiver binds to "
                         "(0.0.0.0 to take transfers from other hosts)")
    kv_advertise_host: str = Field(
        "", description="decode: host prefill workers use to reach the KV receiver; "
        "empty = 127.0.0.1 when binding loopback/any, else kv_host"
    )
    kv_port: int = Field(0, ge=0, le=65535, description="decode: KV receiver port (0 = free)")
    kv_lease_s: float = Field(
        30.0, gt=0, description="prefill: longest hold of a prompt's KV blocks before the "
        "decode side acknowledged them; decode: how long unclaimed transfers are kept",
        json_schema_extra=ADVANCED,
    )
    kv_load_timeout_s: float = Field(
        30.0, gt=0, description="decode: longest wait for a complete KV transfer",
        json_schema_extra=ADVANCED,
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="decode: on a corrupt, late or missing transfer, recompute "
        "the prompt locally, or fail the request"
    )
    redis_url: str = Field("", description="Redis of the cluster: register there and "
                           "heartbeat (empty = standalone, no registration)")
    advertise_host: str = Field("", description="host the router uses to reach this worker's "
                                "gRPC API; empty = 127.0.0.1 for loopback/any binds, else host")
    heartbeat_s: float = Field(1.0, gt=0, description="seconds between registry heartbeats",
                               json_schema_extra=ADVANCED)
    worker_ttl_s: float = Field(3.0, gt=0, description="a worker silent this long drops out "
                                "of routing", json_schema_extra=ADVANCED)
    kv_checksum: Literal["crc32c", "xxh3", "crc32"] = Field(
        "crc32c", description="KV transfers: checksum of every chunk (crc32c and xxh3 run "
        "in native code; crc32 is several times slower; the receiver verifies what the "
        "sender used)", json_schema_extra=ADVANCED)
    kv_shm: bool = Field(True, description="KV transfers between workers on one host go "
                         "through shared memory (off: always the network transport)",
                         json_schema_extra=ADVANCED)
    kv_cuda_ipc: bool = Field(True, description="with kv_shm, workers on one host that both "
                              "run on GPUs move KV device to device over CUDA IPC (off: "
                              "through host shared memory)", json_schema_extra=ADVANCED)
    kv_layerwise: bool = Field(
        True, description="prefill: ship each layer's KV as soon as the layer is computed, "
        "overlapping the transfer with the rest of the forward pass (off: every layer "
        "leaves after the pass, as connectors without layer-wise shipping do; for "
        "comparisons)", json_schema_extra=ADVANCED)
    kv_staging_gib: float = Field(
        0.0, ge=0, description="decode: most KV bytes staged for requests not yet "
        "admitted; beyond, new transfers are refused (0 = the size of the CPU KV cache; "
        "8 GiB on GPUs)", json_schema_extra=ADVANCED)
    kv_header_timeout_s: float = Field(
        10.0, gt=0, description="decode: a KV stream that sends no header this long is "
        "dropped", json_schema_extra=ADVANCED)
    kv_max_streams: int = Field(32, ge=1, description="decode: KV streams received at once; "
                                "more are refused at once (RESOURCE_EXHAUSTED)",
                                json_schema_extra=ADVANCED)
    kv_events: bool = Field(
        True, description="serve the engine's KV cache events (blocks stored, removed, "
        "cleared) to routers on the worker's gRPC port, for their precise prefix index; on "
        "only with prefix caching (off: routers use the approximate index for this worker)")
    allow_fault_injection: bool = Field(
        False, description="accept the `fault` field of internal requests (tests and "
        "failure drills only)",
        json_schema_extra=ADVANCED,
    )

