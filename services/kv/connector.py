"""pdserve's vLLM KV connector, loaded out of tree through
`KVTransferConfig(kv_connector="PdserveConnector",
kv_connector_module_path="services.kv.connector", kv_role="kv_producer"|"kv_consumer")`.

One class, two roles, as vLLM wants it: in the engine-core process it is the scheduler
half (`SchedulerSide`: which blocks to ship or fill, and when to free them); in each
worker process it is the worker half (`Producer` ships layers during the forward pass,
`Consumer` receives transfers and copies blocks into the paged cache). At tensor-parallel
size N there are N worker halves, one per rank, each with its own heads: a prefill rank
ships its heads to the decode ranks that hold them (`tp_layout.kv_pieces`), a decode
rank runs its own receiver and loads its own heads; vLLM counts a request finished
sending or receiving once every rank reported it.

Its configuration is `KVSettings` (services/kv/settings.py), the one definition of the
keys of `kv_connector_extra_config`, their defaults and what each tunes: the worker
service writes it, `__init__` reads it back and refuses a key it does not know.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from services.kv.consumer import Consumer
from services.kv.fingerprint import PeerIdentity
from services.kv.layout import fingerprint_of
from services.kv.metadata import PdserveConnectorMetadata
from services.kv.producer import Producer
from services.kv.scheduler_side import SchedulerSide
from services.kv.settings import KVSettings, rank_port_file
from services.kv.stats import FALLBACKS, FallbackMetrics, PdserveKVStats

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def publish_port(path: str, address: str) -> None:
    """Tells the service which port the receiver bound: binding port 0 here, rather than
    handing down a port picked earlier, leaves no window for another process to take it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(address.rsplit(":", 1)[1])
    os.replace(tmp, path)  # readers never see a half-written file


def _tp_rank() -> int:
    """This model worker's tensor-parallel rank (0 where vLLM set up no TP group)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, AttributeError):
        return 0


def _ipc_device(vllm_config: Any) -> str:
    """This worker's GPU as "cuda:N" where its engine runs on one, else "" (the device is
    set before vLLM builds the connector in a worker)."""
    import torch

    if vllm_config.device_config.device_type != "cuda" or not torch.cuda.is_available():
        return ""
    return f"cuda:{torch.cuda.current_device()}"


class PdserveConnector(KVConnectorBase_V1):
    # Prompt tokens loaded through us count as peer-to-peer hits in vLLM's
    # `vllm:prompt_tokens_by_source` metric.
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kv = self._kv_transfer_config
        self.settings = KVSettings.from_dict(kv.kv_connector_extra_config or {})
        self.is_producer = bool(kv.is_kv_producer)
        block_size = int(vllm_config.cache_config.block_size)
        self.scheduler: SchedulerSide | None = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        # Layers held until the forward pass ends, where layer-wise shipping is off.
        self._held: list[tuple[str, torch.Tensor]] = []
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(block_size, self.is_producer, ranks=tp)
            return
        s = self.settings
        rank = _tp_rank()
        identity = PeerIdentity(s.worker_id, s.epoch, fingerprint_of(vllm_config))
        config = s.transport_config(_ipc_device(vllm_config))
        if self.is_producer:
            self.producer = Producer(identity, config, s.lease_s, s.allow_faults, s.shm,
                                     rank=rank, tp=tp)
        else:
            # One receiver per rank: a fixed port is the first rank's, the next ones'
            # follow it.
            self.consumer = Consumer(
                identity,
                config,
                s.kv_transport,
                s.kv_host,
                s.kv_port + rank if s.kv_port else 0,
                s.load_timeout_s,
                s.unknown_grace_s,
                s.allow_faults,
                rank=rank,
                tp=tp,
            )
            log.info("KV receiver (%s) of rank %d on %s", s.kv_transport, rank,
                     self.consumer.receiver.address)
            if s.port_file:
                publish_port(rank_port_file(s.port_file, rank), self.consumer.receiver.address)

    # -- worker half ------------------------------------------------------------------
    def _meta(self) -> PdserveConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        (self.producer or self.consumer).register_kv_caches(kv_caches)  # type: ignore[union-attr]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.consumer is not None:
            self.consumer.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole requests, finished before they are scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self.producer is None:
            return
        if self.settings.layerwise:
            self.producer.save_kv_layer(self._meta(), layer_name, kv_layer)
        else:
            self._held.append((layer_name, kv_layer))

    def wait_for_save(self) -> None:
        # Called after the forward pass, while this step's metadata and KV cache are
        # still current. Shipping itself runs in the background either way; blocks stay
        # held until it is acked.
        held, self._held = self._held, []
        if self.producer is not None:
            for layer_name, kv_layer in held:
                self.producer.save_kv_layer(self._meta(), layer_name, kv_layer)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.producer is not None:
            return KVConnectorTransferResults(
                finished_sending=self.producer.get_finished(finished_req_ids)
            )
        if self.consumer is not None:
            recved, failed = self.consumer.get_transfer_results()
            return KVConnectorTransferResults(finished_recving=recved, failed_recving=failed)
        return KVConnectorTransferResults()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.producer is None:
            return None
        counts = self.producer.take_fallbacks()
        return PdserveKVStats({FALLBACKS: counts}) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return PdserveKVStats(dict(data) if data else {FALLBACKS: {}})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return FallbackMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> Any:
        return self.consumer.worker_meta() if self.consumer is not None else None

    def shutdown(self) -> None:
        for half in (self.producer, self.consumer):
            if half is not None:
                half.close()

    # -- scheduler half ---------------------------------------------------------------
    def _sched(self) -> SchedulerSide:
        assert self.scheduler is not None
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdserveConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)
