"""Workers announce themselves: a heartbeat task that writes the worker's record, with
its current load, to the registry every interval. A worker that stops heartbeating
drops out of routing when its record's TTL runs out; after a Redis restart the next
heartbeats rebuild the registry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import REGISTRY

from services.registry.records import WorkerLoad, WorkerRecord
from services.registry.registry import Registry

log = logging.getLogger(__name__)


def gauge(name: str) -> float:
    """The first sample of a gauge in this process's Prometheus registry (vLLM's `vllm:*`
    gauges live there, one engine per process)."""
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def vllm_load(queued_prompt_tokens: int) -> WorkerLoad:
    return WorkerLoad(
        waiting=int(gauge("vllm:num_requests_waiting")),
        running=int(gauge("vllm:num_requests_running")),
        queued_prompt_tokens=queued_prompt_tokens,
        kv_usage=gauge("vllm:kv_cache_usage_perc"),
    )


async def heartbeat_forever(registry: Registry, record: Callable[[], WorkerRecord],
                            interval_s: float) -> None:
    failing = False
    while True:
        try:
            await registry.heartbeat(record())
            if failing:
                log.info("registry reachable again; registration restored")
            failing = False
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not failing:
                log.warning("heartbeat to the registry failed (%s); retrying", e)
            failing = True
        await asyncio.sleep(interval_s)
