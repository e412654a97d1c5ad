"""OpenTelemetry tracing for pdserve processes: setup, and W3C trace context in and out.

Off by default. `setup_tracing` turns it on when an OTLP endpoint is given (the
`--otlp-traces-endpoint` flag, else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else
`OTEL_EXPORTER_OTLP_ENDPOINT`), unless `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none`. Spans go to an OTLP/gRPC receiver through a batching
exporter thread, so a request never waits on the tracing backend.

This module keeps its own tracer provider and its own W3C propagator instead of
installing OpenTelemetry's process-wide globals: vLLM (in the same process) and tests
can set up their own without one overwriting the other, and when tracing is off the
helpers test one module variable and return, so there is nothing to measure.

Sampling is parent-based: a request that arrives with a sampled `traceparent` is traced,
one that arrives with an unsampled one is not, and a request without one starts a new
trace that is sampled with the configured ratio. Internal calls carry the router's
decision to the workers, so a trace is whole or absent, never partial. With no ratio
given, the standard `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` apply
(`always_off` turns sampling off even for sampled parents).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

TRACE_KEYS = ("traceparent", "tracestate")  # W3C trace context: the only keys read or sent
PROPAGATOR = TraceContextTextMapPropagator()
LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class TracingState:
    provider: TracerProvider
    tracer: Tracer
    service_name: str
    endpoint: str  # "" when an exporter was handed in (tests)


_state: TracingState | None = None


def enabled() -> bool:
    return _state is not None


def tracer() -> Tracer | None:
    """The tracer of this process, or None when tracing is off."""
    return None if _state is None else _state.tracer


def resolve_endpoint(endpoint: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The OTLP/gRPC endpoint to export to, or "" for tracing off. A bare `host:port` is
    plaintext on loopback and TLS elsewhere (secure unless `http://` is written)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    exporter = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if exporter == "none":
        return ""
    if exporter not in ("", "otlp"):
        log.warning("OTEL_TRACES_EXPORTER=%s: pdserve exports traces over OTLP/gRPC only",
                    exporter)
    value = (endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
             or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "").strip()
    if not value or "://" in value:
        return value
    host = urlparse(f"//{value}").hostname or ""
    loopback = host in LOOPBACK or host.startswith("127.")
    return f"{'http' if loopback else 'https'}://{value}"


def check_ratio(ratio: float) -> float:
    if math.isnan(ratio) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"otlp_sampling_ratio: {ratio} is not in [0, 1]")
    return ratio


def setup_tracing(service_name: str, endpoint: str | None = None, ratio: float | None = None,
                  *, instance_id: str = "", exporter: SpanExporter | None = None) -> bool:
    """Turn tracing on for this process if an endpoint is configured; returns whether it
    is on. `ratio` is the share of new traces sampled (None: the `OTEL_TRACES_SAMPLER`
    variables, default always on). `exporter` replaces the OTLP exporter (tests hand in
    the SDK's in-memory one, exported synchronously). Calling it again replaces the
    previous setup (after flushing it)."""
    global _state
    target = "" if exporter is not None else resolve_endpoint(endpoint)
    if exporter is None and not target:
        shutdown_tracing()
        return False
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    attrs: dict[str, str] = {}
    if not os.environ.get("OTEL_SERVICE_NAME"):  # the standard variable wins
        attrs[SERVICE_NAME] = service_name
    if instance_id:
        attrs[SERVICE_INSTANCE_ID] = instance_id
    sampler = None if ratio is None else ParentBased(TraceIdRatioBased(check_ratio(ratio)))
    provider = TracerProvider(resource=Resource.create(attrs), sampler=sampler)
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        parsed = urlparse(target)
        if parsed.scheme == "http" and parsed.hostname not in LOOPBACK:
            log.warning("traces go to %s in plaintext (http://); use https:// beyond "
                        "loopback", target)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=target)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    shutdown_tracing()
    _state = TracingState(provider, provider.get_tracer("pdserve"), service_name, target)
    log.info("tracing on: service %s, OTLP endpoint %s, sampling %s", service_name,
             target or "(in-process exporter)",
             "from OTEL_TRACES_SAMPLER" if ratio is None else f"ratio {ratio}")
    return True


def setup_from(settings: Any, service_name: str, instance_id: str = "") -> bool:
    """`setup_tracing` from a settings model's `otlp_traces_endpoint` and
    `otlp_sampling_ratio` (ServerConfig: every serving process has them)."""
    return setup_tracing(service_name, settings.otlp_traces_endpoint or None,
                         settings.otlp_sampling_ratio, instance_id=instance_id)


def settings_env(settings: Any) -> dict[str, str]:
    """The tracing settings as PDSERVE_* variables, for child processes (the OTEL_*
    variables are inherited with the environment anyway)."""
    env = {}
    if settings.otlp_traces_endpoint:
        env["PDSERVE_OTLP_TRACES_ENDPOINT"] = str(settings.otlp_traces_endpoint)
    if settings.otlp_sampling_ratio is not None:
        env["PDSERVE_OTLP_SAMPLING_RATIO"] = str(settings.otlp_sampling_ratio)
    return env


def force_flush(timeout_s: float = 5.0) -> bool:
    """Export what is buffered now (before a process exits, or in tests)."""
    return True if _state is None else _state.provider.force_flush(int(timeout_s * 1000))


def shutdown_tracing() -> None:
    """Flush and stop the exporter; tracing is off afterwards."""
    global _state
    state, _state = _state, None
    if state is not None:
        state.provider.shutdown()


# -- trace context in -------------------------------------------------------------------
def trace_headers(pairs: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """The W3C keys among gRPC metadata pairs (keys arrive lower-case)."""
    out: dict[str, str] = {}
    for key, value in pairs or ():
        if key in TRACE_KEYS and isinstance(value, str):
            out[key] = value
    return out


def carried(pairs: Iterable[tuple[str, str | bytes]] | None) -> tuple[tuple[str, str], ...]:
    """The caller's W3C headers to keep with a request (`GenerationRequest.trace_headers`),
    from gRPC metadata or HTTP headers' items; () when tracing is off."""
    if _state is None:
        return ()
    return tuple(trace_headers((k.lower(), v) for k, v in pairs or ()).items())


def extract_grpc(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The caller's trace context from gRPC invocation metadata
    (`context.invocation_metadata()`); None when tracing is off or none was sent."""
    if _state is None:
        return None
    headers = trace_headers(metadata)
    return PROPAGATOR.extract(headers) if headers else None


def extract_http(headers: Mapping[str, str]) -> Context | None:
    """The caller's trace context from HTTP request headers (any case-insensitive
    mapping, as Starlette's); None when tracing is off or none was sent."""
    if _state is None:
        return None
    found = {k: v for k in TRACE_KEYS if (v := headers.get(k))}
    return PROPAGATOR.extract(found) if found else None
