"""`pdserve prefill` / `pdserve decode`: start the engine, serve the role's gRPC service,
register in the registry and heartbeat, and leave rotation at once when the engine dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from services.engine.config import EngineConfig
from services.errors import EngineDead
from services.kv.worker_ext import watch_staging
from services.observability import tracing
from services.registry.config import ClusterStateConfig
from services.registry.heartbeat import heartbeat_forever
from services.registry.registry import Registry
from services.security.policy import internal_tls
from services.server.channels import local_host
from services.server.grpc_server import Bound, Service, serve
from services.server.listener import Listener
from services.server.settings import ServerConfig
from services.worker.config import Role, WorkerConfig
from services.worker.decode import decode_service
from services.worker.prefill import prefill_service
from services.worker.worker import Worker

log = logging.getLogger(__name__)

ENGINE_PROBE_S = 0.5  # how often the engine's liveness is checked


def metrics_host(server_cfg: ServerConfig, advertised: str) -> str:
    """The host Prometheus reaches this worker's metrics port at: the gRPC API's
    advertised host when both bind the same interface (or every one), else the metrics
    port's own bind address."""
    bind = server_cfg.metrics_host
    if not bind or bind == server_cfg.host or bind in ("0.0.0.0", "::"):
        return advertised
    return bind


async def _watch_engine(worker: Worker, died: asyncio.Event, stop: asyncio.Event) -> None:
    while not worker.engine.dead:
        await asyncio.sleep(ENGINE_PROBE_S)
    log.error("the engine of %s died: leaving rotation and exiting",
              worker.identity.worker_id)
    died.set()
    stop.set()


async def run_worker(role: Role, engine_cfg: EngineConfig, server_cfg: ServerConfig,
                     config: WorkerConfig, on_ready: Callable[[int], None] | None = None,
                     cluster: ClusterStateConfig | None = None,
                     stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then leave the registry at once and
    let running streams finish for up to `server_cfg.grace_s`. Raises `EngineDead` when
    the engine died, after the worker turned NOT_SERVING and removed its record, so that
    its supervisor (Ray, a Kubernetes restart policy) starts a new one."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # The signer first: a missing cluster secret fails before the engine spends a minute.
    signer = (cluster or ClusterStateConfig()).signer(  # type: ignore[call-arg]
        f"{role} worker") if config.redis_url else None
    # The KV transports serve and dial with this process's internal mTLS identity.
    worker = Worker.start(role, engine_cfg, config, tls=internal_tls(server_cfg))
    await worker.engine.warm_up()  # before it serves: no user request pays first-use costs
    tracing.setup_from(server_cfg, f"pdserve-{role}", worker.identity.worker_id)
    # A prefill worker also answers Decode for whole requests (no transfer handle): with
    # the decode pool gone, the router sends it whole requests instead of refusing them.
    services: list[Service] = ([prefill_service(worker), decode_service(worker)]
                               if role == "prefill" else [decode_service(worker)])
    banner = (f"pdserve {role} worker {worker.identity.worker_id} (epoch "
              f"{worker.identity.epoch}, layout {worker.fingerprint.digest()})")
    registry = Registry.from_url(config.redis_url, ttl_s=config.worker_ttl_s,
                                 signer=signer) if config.redis_url else None
    stop, died = stop or asyncio.Event(), asyncio.Event()
    heartbeats: list[asyncio.Task[None]] = []
    tasks: list[asyncio.Task[None]] = [asyncio.create_task(_watch_engine(worker, died, stop))]
    if role == "decode":
        tasks.append(asyncio.create_task(watch_staging(worker.engine.llm)))

    async def leave_rotation() -> None:
        # First thing on stop, while the server drains: a record kept until after the
        # drain would have routers send new requests that the draining server refuses.
        await stop.wait()
        for task in heartbeats:
            task.cancel()
        if registry is not None:
            with contextlib.suppress(Exception):
                await registry.deregister(worker.identity.worker_id)
        # Routers' WatchKVEvents streams never end by themselves: ended here, they do
        # not hold the drain for its whole grace period.
        if worker.kv_events is not None:
            await asyncio.to_thread(worker.kv_events.close)

    tasks.append(asyncio.create_task(leave_rotation()))

    def register(bound: Bound) -> None:
        if on_ready is not None:
            on_ready(bound.port)
        if registry is None:
            return
        host = config.advertise_host or local_host(server_cfg.host)
        metrics = (f"{metrics_host(server_cfg, host)}:{bound.metrics_port}"
                   if bound.metrics_port else "")
        heartbeats.append(asyncio.create_task(heartbeat_forever(
            registry, lambda: worker.record(f"{host}:{bound.port}", bound.metrics_port,
                                            metrics), config.heartbeat_s)))

    try:
        await serve(server_cfg, services, banner, Listener.internal(server_cfg),
                    on_ready=register, stop=stop)
    finally:
        for task in (*tasks, *heartbeats):
            task.cancel()
        if registry is not None:
            with contextlib.suppress(Exception):
                await registry.deregister(worker.identity.worker_id)
            await registry.close()
        worker.engine.shutdown()
        if worker.kv_events is not None:
            worker.kv_events.close()
        tracing.shutdown_tracing()  # the last spans are exported before the process ends
    if died.is_set():
        raise EngineDead(f"the engine of {worker.identity.worker_id} died")
