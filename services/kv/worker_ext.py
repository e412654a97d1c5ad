"""What a decode worker asks of its KV receiver: the staging level, as gauges on the
worker's metrics port, and releasing a transfer no Decode call will take.

The receiver stages inbound transfers inside vLLM's model-worker process, where the
connector's worker half lives, not in the pdserve worker process that Prometheus scrapes
and that serves the Release RPC. vLLM's per-step connector stats (`stats.py`) cannot
carry a level: they flow only while the engine steps, so a gauge fed by them would keep
its last value once the load stops. Instead `KVWorkerExtension` (vLLM's
`worker_extension_cls`) adds methods to the model worker, and the pdserve worker calls
them with `AsyncLLM.collective_rpc`, which the engine core answers even when idle.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from prometheus_client import Gauge

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from services.kv.consumer import Consumer

log = logging.getLogger(__name__)

EXTENSION = f"{__name__}.KVWorkerExtension"
READ_METHOD = "pdserve_kv_staged"
RELEASE_METHOD = "pdserve_kv_release"

STAGED_TRANSFERS = Gauge(
    "pdserve_kv_staged_transfers",
    "inbound KV transfers held in this decode worker's staging (receiving or received, "
    "not yet loaded into the paged cache or dropped)",
)
STAGED_BYTES = Gauge("pdserve_kv_staged_bytes", "bytes of KV held in this worker's staging")


class KVWorkerExtension:
    """Mixed into vLLM's model worker class (`worker_extension_cls`)."""

    def pdserve_kv_staged(self) -> tuple[int, int]:
        consumer = _consumer()
        return (0, 0) if consumer is None else consumer.receiver.staged()

    def pdserve_kv_release(self, transfer_id: str) -> None:
        consumer = _consumer()
        if consumer is not None:
            consumer.receiver.discard(transfer_id)


def _consumer() -> Consumer | None:
    """This model worker's consumer half, if the engine is a decode worker's."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), "consumer", None)  # a producer has none


async def read_staged(llm: AsyncLLM) -> tuple[int, int]:
    """(transfers, bytes) staged, summed over the engine's model workers."""
    per_worker = await llm.collective_rpc(READ_METHOD, timeout=5.0)
    return sum(int(n) for n, _ in per_worker), sum(int(b) for _, b in per_worker)


async def release(llm: AsyncLLM, transfer_id: str) -> None:
    """Drop a staged (or still arriving) transfer in every model worker now."""
    await llm.collective_rpc(RELEASE_METHOD, timeout=5.0, args=(transfer_id,))


async def watch_staging(llm: AsyncLLM, period_s: float = 2.0) -> None:
    """Keep the gauges current until cancelled; a failed read is logged once and retried."""
    failed = False
    while True:
        try:
            transfers, nbytes = await read_staged(llm)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not failed:
                log.warning("could not read the KV staging level: %s", e)
            failed = True
        else:
            failed = False
            STAGED_TRANSFERS.set(transfers)
            STAGED_BYTES.set(nbytes)
        await asyncio.sleep(period_s)
