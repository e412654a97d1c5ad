"""The public gRPC server: generation service, `grpc.health.v1`, server reflection and
a Prometheus endpoint, with a graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdserve.v1 import generate_pb2 as pb
from services import wire
from services.api.backend import Backend
from services.api.servicer import GenerationServicer, parse_request
from services.rpc import MAX_MESSAGE_BYTES, grpc_options, use_internal_tls
from services.security.policy import (
    PublicAuth,
    add_internal_port,
    check_public_bind,
    internal_tls,
    is_loopback,
)
from services.security.tls import TLSFiles

log = logging.getLogger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name


class ServerConfig(BaseSettings):
    """Where and how the public API listens. Env prefix PDSERVE_."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    host: str = Field("127.0.0.1", description="address the gRPC and HTTP APIs bind to "
                      "(0.0.0.0: every interface; beyond loopback the public API needs API "
                      "keys or TLS, or --allow-insecure)")
    port: int = Field(50051, ge=0, le=65535, description="gRPC API port (0 = any free port)")
    metrics_port: int = Field(
        9400, ge=-1, le=65535, description="Prometheus /metrics port (0 = off, -1 = any free "
        "port, published in the registry)"
    )
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES, ge=4 << 20, description="largest gRPC message accepted or sent"
    )
    grace_s: float = Field(10.0, ge=0, description="seconds running streams get on shutdown")
    otlp_traces_endpoint: str = Field(
        "", description="OpenTelemetry traces over OTLP/gRPC to this collector (empty: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off); host:port is plaintext on loopback, "
        "TLS elsewhere (docs/observability.md)")
    otlp_sampling_ratio: float | None = Field(
        None, ge=0.0, le=1.0, description="share of new traces sampled, 0..1 (a client's "
        "sampled traceparent is always followed); unset: OTEL_TRACES_SAMPLER, else 1")
    http_port: int = Field(
        0, ge=0, le=65535, description="OpenAI-compatible HTTP API port (0 = off)"
    )
    metrics_host: str = Field("", description="address the Prometheus port binds to (empty: "
                              "the same as host)")
    health_port: int = Field(
        0, ge=0, le=65535, description="a plaintext port serving grpc.health.v1 only, for "
        "probes that speak neither TLS nor API keys (0 = off)")
    # Security (docs/security.md).
    api_keys_file: str = Field(
        "", description="public API: a file of `client-name:key` lines (PDSERVE_API_KEYS "
        "adds comma-separated ones); other calls are refused UNAUTHENTICATED / HTTP 401")
    tls_cert_file: str = Field("", description="public API: TLS certificate chain (PEM)")
    tls_key_file: str = Field("", description="public API: TLS private key (PEM)")
    tls_client_ca_file: str = Field(
        "", description="public API: require client certificates from this CA (mTLS)")
    allow_insecure: bool = Field(
        False, description="serve the public API beyond loopback with neither API keys nor "
        "TLS (logged as a warning at start)")
    internal_tls_ca_file: str = Field(
        "", description="internal mTLS (router <-> workers, KV transports): the CA peers' "
        "certificates must chain to")
    internal_tls_cert_file: str = Field(
        "", description="internal mTLS: this process's certificate (DNS name "
        "pdserve.internal)")
    internal_tls_key_file: str = Field("", description="internal mTLS: its private key")
    internal_reflection: bool = Field(
        False, description="worker ports: serve gRPC reflection too (off: it lists the "
        "internal API to whoever connects)")


@dataclass(frozen=True, slots=True)
class Bound:
    """What a started server listens on."""

    port: int  # gRPC
    metrics_port: int  # Prometheus (0 = off)


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


@dataclass(frozen=True, slots=True)
class Listener:
    """How a server's gRPC port is secured: the public API's credentials, or internal
    mTLS (worker ports)."""

    auth: PublicAuth | None  # None: an internal port
    internal_tls: TLSFiles | None

    @classmethod
    def of(cls, config: ServerConfig, internal: bool) -> Listener:
        files = internal_tls(config)
        use_internal_tls(files)  # this process's identity, for the peers it dials
        if internal:
            if files is None and not is_loopback(config.host):
                log.warning("worker port on %s without internal TLS: anyone who reaches it "
                            "can call it (set --internal-tls-*-file)", config.host)
            return cls(None, files)
        auth = PublicAuth.of(config)
        check_public_bind(config.host, auth, config.allow_insecure)
        return cls(auth, files)

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if self.auth is None:
            return add_internal_port(server, address, self.internal_tls)
        return self.auth.add_port(server, address)


@dataclass(frozen=True, slots=True)
class Service:
    """One gRPC service to serve: its full name and how to add it to a server."""

    name: str
    register: Callable[[grpc.aio.Server], None]


def generation_service(backend: Backend) -> Service:
    servicer = GenerationServicer(backend)
    # As the generated `add_GenerationServiceServicer_to_server`, but requests that do not
    # parse reach the servicer as an error to answer INVALID_ARGUMENT with (grpc would
    # answer a deserializer's exception with an opaque UNKNOWN), and chunks forwarded
    # from a worker go out as the bytes they came in.
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=parse_request,
            response_serializer=wire.serialize_response),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.GetModelInfoResponse.SerializeToString),
    }
    generic = grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers)
    return Service(GENERATION_SERVICE, lambda server: server.add_generic_rpc_handlers((generic,)))


async def serve(
    config: ServerConfig,
    services: list[Service],
    banner: str,
    on_ready: Callable[[Bound], None] | None = None,
    stop: asyncio.Event | None = None,
    *,
    http_backend: Backend | None = None,
    internal: bool = False,
) -> None:
    """Serve `services` plus health and reflection until SIGTERM/SIGINT (or `stop` is
    set), then drain gracefully. With `config.http_port` and `http_backend`, the
    OpenAI-compatible HTTP API serves that backend too, in this event loop. The public
    API takes API keys and TLS from `config`; an `internal` server (a worker) takes
    internal mTLS and no reflection unless `config.internal_reflection`."""
    listener = Listener.of(config, internal)
    interceptors = listener.auth.interceptors() if listener.auth else []
    server = grpc.aio.server(interceptors=interceptors,
                             options=grpc_options(config.max_message_bytes))
    for service in services:
        service.register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.name for s in services]
    if not internal or config.internal_reflection:
        reflection.enable_server_reflection(
            (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = listener.add_port(server, f"{config.host}:{config.port}")
    await server.start()
    health_only = await start_health_only(health_servicer, config.host, config.health_port)
    http = None
    if config.http_port and http_backend is not None:
        from services.api.openai_http import HttpServer

        http = HttpServer(http_backend, config.host, config.http_port, config.grace_s,
                          auth=listener.auth)
        await http.start()
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
    await asyncio.gather(server.stop(config.grace_s), *([http.stop()] if http else []))
    if health_only is not None:
        await health_only.stop(None)
