"""A pdserve gRPC server: the services given, `grpc.health.v1`, server reflection, a
Prometheus endpoint and an optional plaintext health-only port, secured by a
`Listener`, with a graceful stop on SIGTERM/SIGINT. Every process serves through here:
the public API (router, colocated) and the workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.server.channels import grpc_options
from services.server.inflight import InFlight
from services.server.listener import Listener
from services.server.settings import ServerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Bound:
    """What a started server listens on."""

    port: int  # gRPC
    metrics_port: int  # Prometheus (0 = off)


@dataclass(frozen=True, slots=True)
class Service:
    """One gRPC service to serve: its full name and how to add it to a server."""

    name: str
    register: Callable[[grpc.aio.Server], None]


class Companion(Protocol):
    """Another server of the process that starts after the gRPC port listens and
    drains with it (the OpenAI-compatible HTTP API)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def start_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Serve the process's Prometheus registry (vLLM's `vllm:*` metrics live there) on
    `host`; returns the port bound (0 when off)."""
    if not port:
        return 0
    from prometheus_client import start_http_server

    httpd, _ = start_http_server(max(port, 0), addr=host.strip("[]"))
    bound = int(httpd.server_port)
    log.info("metrics on %s:%d/metrics", host, bound)
    return bound


async def start_health_only(health_servicer: health.aio.HealthServicer, host: str,
                            port: int) -> grpc.aio.Server | None:
    """A plaintext server answering grpc.health.v1 only (SERVING or not, nothing else),
    for probes (the kubelet's) that cannot present credentials."""
    if not port:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server


async def drain(server: grpc.aio.Server, inflight: InFlight, grace_s: float) -> None:
    """The calls in flight get up to `grace_s` to end with the port still open (health
    checks answered, new calls refused), then the server stops, cutting what is left."""
    started = time.monotonic()
    if not await inflight.drain(grace_s):
        log.warning("%d call(s) still running after the %.0f s grace period: cut",
                    inflight.calls, grace_s)
    await server.stop(max(0.0, grace_s - (time.monotonic() - started)))


async def serve(
    config: ServerSettings,
    services: Sequence[Service],
    banner: str,
    listener: Listener,
    on_ready: Callable[[Bound], None] | None = None,
    stop: asyncio.Event | None = None,
    *,
    companions: Sequence[Companion] = (),
) -> None:
    """Serve `services` plus health (and reflection when `listener` allows it) on
    `listener`'s port until SIGTERM/SIGINT (or `stop` is set), then drain gracefully;
    `companions` start once the port listens and stop with it."""
    inflight = InFlight()
    server = grpc.aio.server(interceptors=[*listener.interceptors(), inflight],
                             options=grpc_options(config.max_message_bytes))
    for service in services:
        service.register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.name for s in services]
    if listener.reflection:
        reflection.enable_server_reflection(
            (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = listener.add_port(server, f"{config.host}:{config.port}")
    await server.start()
    health_only = await start_health_only(health_servicer, config.host, config.health_port)
    for companion in companions:
        await companion.start()
    metrics_port = start_metrics(config.metrics_port, config.metrics_host or config.host)
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s on %s:%d", banner, config.host, port)
    if on_ready is not None:
        on_ready(Bound(port, metrics_port))

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Not in the main thread (a Ray actor's loop): the host process handles signals.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining for up to %.0f s", config.grace_s)
    # NOT_SERVING first, so load balancers stop sending new work while streams finish.
    await health_servicer.enter_graceful_shutdown()
    await asyncio.gather(drain(server, inflight, config.grace_s),
                         *(c.stop() for c in companions))
    if health_only is not None:
        await health_only.stop(None)
