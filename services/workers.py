"""What prefill and decode workers share: their settings, identity (id and restart
epoch), the KV connector configuration of their engine, and how they are served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdserve.v1 import worker_pb2 as wpb
from services.api.server import ServerConfig, Service, serve
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.kv.fingerprint import LayoutFingerprint
from services.kv.layout import fingerprint_of
from services.registry.heartbeat import heartbeat_forever, vllm_load
from services.registry.records import WorkerRecord
from services.registry.registry import Registry

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]


class WorkerConfig(BaseSettings):
    """Prefill/decode worker settings. Env prefix PDSERVE_."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    worker_id: str = Field("", description="worker name; empty = <role>-<host>-<random>")
    kv_transport: Literal["grpc", "torch"] = Field(
        "grpc", description="decode: how KV arrives (grpc: any host; torch: torch.distributed "
        "pair groups, gloo on CPU, NCCL on GPU)"
    )
    kv_host: str = Field("0.0.0.0", description="decode: address the KV receiver binds to")
    kv_advertise_host: str = Field(
        "", description="decode: host prefill workers use to reach the KV receiver; "
        "empty = 127.0.0.1 when binding loopback/any, else kv_host"
    )
    kv_port: int = Field(0, ge=0, le=65535, description="decode: KV receiver port (0 = free)")
    kv_lease_s: float = Field(
        30.0, gt=0, description="prefill: longest hold of a prompt's KV blocks before the "
        "decode side acknowledged them; decode: how long unclaimed transfers are kept"
    )
    kv_load_timeout_s: float = Field(
        30.0, gt=0, description="decode: longest wait for a complete KV transfer"
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="decode: on a corrupt, late or missing transfer, recompute "
        "the prompt locally, or fail the request"
    )
    redis_url: str = Field("", description="Redis of the cluster: register there and "
                           "heartbeat (empty = standalone, no registration)")
    advertise_host: str = Field("", description="host the router uses to reach this worker's "
                                "gRPC API; empty = 127.0.0.1 for loopback/any binds, else host")
    heartbeat_s: float = Field(1.0, gt=0, description="seconds between registry heartbeats")
    worker_ttl_s: float = Field(3.0, gt=0, description="a worker silent this long drops out "
                                "of routing")
    allow_fault_injection: bool = Field(
        False, description="accept the `fault` field of internal requests (tests and "
        "failure drills only)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def local_host(bind_host: str) -> str:
    """The address peers on this machine use for a server bound to `bind_host`."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "127.0.0.1", "") else bind_host


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    worker_id: str
    role: Role
    # A new epoch on every start: transfer handles minted before a restart name the old
    # epoch and are refused instead of being matched against state that is gone.
    epoch: int

    @classmethod
    def new(cls, role: Role, worker_id: str = "") -> WorkerIdentity:
        name = worker_id or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        return cls(name, role, time.time_ns())


def kv_transfer_config(identity: WorkerIdentity, config: WorkerConfig,
                       port_file: str = "") -> Any:
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {
        "worker_id": identity.worker_id, "epoch": identity.epoch, "port_file": port_file,
        "kv_host": config.kv_host, "kv_port": config.kv_port,
        "kv_transport": config.kv_transport,
        "lease_s": config.kv_lease_s, "load_timeout_s": config.kv_load_timeout_s,
        "allow_faults": config.allow_fault_injection,
    }
    return KVTransferConfig(
        kv_connector="PdserveConnector",
        kv_connector_module_path="services.kv.connector",
        kv_role="kv_producer" if identity.role == "prefill" else "kv_consumer",
        kv_load_failure_policy=config.kv_load_failure_policy,
        kv_connector_extra_config=extra,
    )


@dataclass
class Worker:
    """A started engine with its identity and KV layout."""

    identity: WorkerIdentity
    config: WorkerConfig
    engine: Engine
    fingerprint: LayoutFingerprint
    kv_address: str

    @classmethod
    def start(cls, role: Role, engine_cfg: EngineConfig, config: WorkerConfig) -> Worker:
        identity = WorkerIdentity.new(role, config.worker_id)
        address = ""
        with tempfile.TemporaryDirectory(prefix="pdserve-kv-") as tmp:
            # decode: the KV receiver binds its port inside the engine and writes it here
            port_file = str(Path(tmp) / "port") if role == "decode" else ""
            engine = Engine(engine_cfg, kv_transfer_config(identity, config, port_file))
            engine.start()
            if role == "decode":
                host = config.kv_advertise_host or local_host(config.kv_host)
                address = f"{host}:{Path(port_file).read_text().strip()}"
        return cls(identity, config, engine, fingerprint_of(engine.llm.vllm_config), address)

    def record(self, address: str, metrics_port: int = 0) -> WorkerRecord:
        """This worker as the registry shows it, with its current load."""
        facts = self.engine.facts
        llm = self.engine.llm
        return WorkerRecord(
            worker_id=self.identity.worker_id, role=self.identity.role, address=address,
            host=socket.gethostname(), epoch=self.identity.epoch,
            fingerprint=self.fingerprint.digest(), kv_address=self.kv_address,
            kv_transport=self.config.kv_transport if self.identity.role == "decode" else "",
            metrics_port=metrics_port,
            capacity=self.engine.config.max_num_seqs, model=facts.name,
            max_model_len=facts.max_model_len, vocab_size=facts.vocab_size, dtype=facts.dtype,
            load=vllm_load(int(llm.get_num_queued_tokens())), updated=time.time(),
            pid=os.getpid(),
        )

    def info(self) -> wpb.WorkerInfo:
        facts = self.engine.facts
        role = wpb.WORKER_ROLE_PREFILL if self.identity.role == "prefill" else (
            wpb.WORKER_ROLE_DECODE)
        return wpb.WorkerInfo(
            worker_id=self.identity.worker_id, role=role, epoch=self.identity.epoch,
            fingerprint_digest=self.fingerprint.digest(),
            fingerprint_json=json.dumps(self.fingerprint.to_dict()),
            kv_address=self.kv_address, kv_transport=self.config.kv_transport,
            model=facts.name, max_model_len=facts.max_model_len, vocab_size=facts.vocab_size,
            kv_load_failure_policy=self.config.kv_load_failure_policy,
        )


async def run_worker(role: Role, engine_cfg: EngineConfig, server_cfg: ServerConfig,
                     config: WorkerConfig, on_ready: Callable[[int], None] | None = None
                     ) -> None:
    from services.decode.servicer import decode_service
    from services.prefill.servicer import prefill_service

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    worker = Worker.start(role, engine_cfg, config)
    service: Service = prefill_service(worker) if role == "prefill" else decode_service(worker)
    banner = (f"pdserve {role} worker {worker.identity.worker_id} (epoch "
              f"{worker.identity.epoch}, layout {worker.fingerprint.digest()})")
    registry = Registry.from_url(config.redis_url, ttl_s=config.worker_ttl_s) if (
        config.redis_url) else None
    tasks: list[asyncio.Task[None]] = []

    def register(port: int) -> None:
        if on_ready is not None:
            on_ready(port)
        if registry is None:
            return
        host = config.advertise_host or local_host(server_cfg.host)
        tasks.append(asyncio.create_task(heartbeat_forever(
            registry, lambda: worker.record(f"{host}:{port}", server_cfg.bound_metrics_port),
            config.heartbeat_s)))

    try:
        await serve(server_cfg, [service], banner, on_ready=register)
    finally:
        for task in tasks:
            task.cancel()
        if registry is not None:
            with contextlib.suppress(Exception):
                await registry.deregister(worker.identity.worker_id)
            await registry.close()
        worker.engine.shutdown()
