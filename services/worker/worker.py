"""What prefill and decode workers share: identity (id and restart epoch), the KV
connector configuration of their engine, the started engine and how the registry and
the router see it."""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.engine.config import EngineConfig, cpu_only
from services.engine.engine import Engine
from services.kv.fingerprint import LayoutFingerprint
from services.kv.layout import fingerprint_of
from services.kv.settings import TRANSPORT_DEFAULTS, KVSettings, rank_port_file
from services.kv.tp_layout import LayoutRefused, kv_heads_per_rank, kv_workers_tp_problem
from services.registry.heartbeat import vllm_load
from services.registry.records import WorkerRecord
from services.security.tls import TLSFiles
from services.server.channels import local_host
from services.worker.config import Role, WorkerConfig
from services.worker.kv_events import EventRelay

log = logging.getLogger(__name__)


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


def kv_settings(identity: WorkerIdentity, config: WorkerConfig, port_file: str,
                staging_bytes: int, tls: TLSFiles | None) -> KVSettings:
    """The KV connector's settings for this worker: `config`'s KV settings under the
    worker's identity; `port_file` (decode) is where the receiver writes the port it
    bound; `staging_bytes` caps the receiver's staging (0: the transports' default);
    `tls` is the worker's internal mTLS identity (None: plaintext)."""
    files = tls or TLSFiles()
    return KVSettings(
        worker_id=identity.worker_id, epoch=identity.epoch, kv_host=config.kv_host,
        kv_port=config.kv_port, port_file=port_file, kv_transport=config.kv_transport,
        lease_s=config.kv_lease_s, load_timeout_s=config.kv_load_timeout_s,
        checksum=config.kv_checksum, max_streams=config.kv_max_streams, shm=config.kv_shm,
        cuda_ipc=config.kv_cuda_ipc, layerwise=config.kv_layerwise,
        header_timeout_s=config.kv_header_timeout_s,
        max_staged_bytes=staging_bytes or TRANSPORT_DEFAULTS.max_staged_bytes,
        tls_ca_file=str(files.ca or ""), tls_cert_file=str(files.cert or ""),
        tls_key_file=str(files.key or ""), allow_faults=config.allow_fault_injection,
    )


def kv_transfer_config(identity: WorkerIdentity, config: WorkerConfig, port_file: str = "",
                       kv_cache_bytes: int = 0, tls: TLSFiles | None = None) -> Any:
    """vLLM's KV transfer config for this worker's role. The receiver's staging cap is
    `kv_staging_gib`, or else the size of the engine's KV cache (a decode worker never
    needs to hold more than it could admit)."""
    from vllm.config import KVTransferConfig

    staging = int(config.kv_staging_gib * (1 << 30)) or kv_cache_bytes
    settings = kv_settings(identity, config, port_file, staging, tls)
    return KVTransferConfig(
        kv_connector="PdserveConnector",
        kv_connector_module_path="services.kv.connector",
        kv_role="kv_producer" if identity.role == "prefill" else "kv_consumer",
        kv_load_failure_policy=config.kv_load_failure_policy,
        kv_connector_extra_config=settings.to_dict(),
    )


@dataclass
class Worker:
    """A started engine with its identity and KV layout."""

    identity: WorkerIdentity
    config: WorkerConfig
    engine: Engine
    fingerprint: LayoutFingerprint
    kv_address: str  # decode: the first rank's KV receiver ("" on prefill)
    # decode: every rank's KV receiver, in rank order (the first is `kv_address`)
    kv_addresses: tuple[str, ...] = ()
    # The engine's KV cache events, served to routers by WatchKVEvents (None: off)
    kv_events: EventRelay | None = None

    @classmethod
    def start(cls, role: Role, engine_cfg: EngineConfig, config: WorkerConfig,
              tls: TLSFiles | None = None) -> Worker:
        """Start the engine; its KV channels use the internal mTLS identity `tls` (None:
        plaintext)."""
        if role == "prefill" and engine_cfg.speculative_config:
            # A prefill worker samples one token per request: drafts could never pay for
            # the proposer's start-up and memory.
            log.info("prefill worker: speculative decoding is for decode workers; starting "
                     "without it")
            engine_cfg = engine_cfg.model_copy(update={"speculative_config": ""})
        tp = engine_cfg.tensor_parallel_size
        problem = kv_workers_tp_problem(tp, tp)
        if problem:  # before a minute of engine start-up, not after
            raise LayoutRefused(f"{role} worker: {problem}")
        identity = WorkerIdentity.new(role, config.worker_id)
        addresses: list[str] = []
        # The events tell routers which blocks the engine holds; without a prefix cache
        # it holds none worth routing to.
        relay = (EventRelay() if config.kv_events and engine_cfg.enable_prefix_caching
                 else None)
        with tempfile.TemporaryDirectory(prefix="pdserve-kv-") as tmp:
            # decode: the KV receiver binds its port inside the engine and writes it here
            port_file = str(Path(tmp) / "port") if role == "decode" else ""
            cache = int(engine_cfg.kv_cache_gib * (1 << 30)) if cpu_only() else 0
            engine = Engine(engine_cfg,
                            kv_transfer_config(identity, config, port_file, cache, tls),
                            relay.engine_config() if relay is not None else None)
            try:
                engine.start()
            except BaseException:
                if relay is not None:
                    relay.close()
                raise
            if role == "decode":  # each rank's receiver wrote its port before the start
                host = config.kv_advertise_host or local_host(config.kv_host)
                addresses = [
                    f"{host}:{Path(rank_port_file(port_file, rank)).read_text().strip()}"
                    for rank in range(tp)]
        return cls(identity, config, engine, fingerprint_of(engine.llm.vllm_config),
                   addresses[0] if addresses else "", tuple(addresses), relay)

    def record(self, address: str, metrics_port: int = 0,
               metrics_address: str = "") -> WorkerRecord:
        """This worker as the registry shows it, with its current load."""
        facts = self.engine.facts
        llm = self.engine.llm
        return WorkerRecord(
            worker_id=self.identity.worker_id, role=self.identity.role, address=address,
            host=socket.gethostname(), epoch=self.identity.epoch,
            fingerprint=self.fingerprint.digest(), kv_address=self.kv_address,
            kv_transport=self.config.kv_transport if self.identity.role == "decode" else "",
            metrics_port=metrics_port, metrics_address=metrics_address,
            capacity=self.engine.config.max_num_seqs, model=facts.name,
            max_model_len=facts.max_model_len, vocab_size=facts.vocab_size, dtype=facts.dtype,
            tp=self.engine.config.tensor_parallel_size,
            kv_heads=kv_heads_per_rank(self.engine.config.tensor_parallel_size,
                                       self.fingerprint.num_kv_heads),
            block_size=self.fingerprint.block_size, kv_addresses=self.kv_addresses,
            kv_events=self.kv_events is not None,
            load=vllm_load(int(llm.get_num_queued_tokens())), updated=time.time(),
            pid=os.getpid(), loras=tuple(self.engine.adapter_paths().items()),
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
            host=socket.gethostname(), capacity=self.engine.config.max_num_seqs,
            dtype=facts.dtype, kv_addresses=list(self.kv_addresses),
            tp=self.engine.config.tensor_parallel_size, lora_adapters=[
                pb.LoraAdapter(name=name, parent=facts.name, path=path)
                for name, path in self.engine.adapter_paths().items()],
        )

