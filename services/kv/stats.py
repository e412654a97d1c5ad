"""The connector's counters, carried by vLLM's connector-stats path: the worker half
returns them from `get_kv_connector_stats()`, vLLM ships them to the front-end process,
and `FallbackMetrics.observe` adds them to a Prometheus counter there (the process whose
registry pdserve's metrics port serves).

`pdserve_kv_transport_fallbacks_total{reason}` (plus vLLM's model_name/engine labels):
transfers that went over a slower transport than the one chosen for them, by reason.
Same-host transfers that went over a network transport: "shm_disabled" (the prefill
worker's `shm` key is false), "receiver_refuses_shm" (the decode worker does not serve
shared memory), "shm_setup_failed" (its segment could not be mapped here). Transfers a
nixl sender handed to gRPC: "receiver_refuses_nixl" (the decode worker does not serve
NIXL), "nixl_staging_full" (no free region in its registered arena or the sender's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

FALLBACKS = "fallbacks"


@dataclass
class PdserveKVStats(KVConnectorStats):
    """data = {"fallbacks": {reason: count}}."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {FALLBACKS: {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine: dict[str, int] = dict(self.data.get(FALLBACKS, {}))
        for reason, n in dict(other.data.get(FALLBACKS, {})).items():
            mine[str(reason)] = mine.get(str(reason), 0) + int(n)
        return PdserveKVStats({FALLBACKS: mine})

    def reduce(self) -> dict[str, int | float]:
        return {f"fallbacks_{k}": int(v) for k, v in self.data.get(FALLBACKS, {}).items()}

    def is_empty(self) -> bool:
        return not any(self.data.get(FALLBACKS, {}).values())


class FallbackMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counter = self._counter_cls(
            name="pdserve_kv_transport_fallbacks",
            documentation="KV transfers that went over a slower transport than the one chosen "
            "for them (same-host ones over the network, nixl ones over gRPC), by reason",
            labelnames=[*labelnames, "reason"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues.get(engine_idx, [])
        for reason, n in dict(transfer_stats_data.get(FALLBACKS, {})).items():
            if int(n) > 0:
                self._counter.labels(*values, str(reason)).inc(int(n))
