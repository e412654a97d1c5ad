"""The spans of one request, and what each records.

One request is one trace:

    pdserve.router            the router (or `serve --mode disagg`): admission, the pair
    |                         chosen and why; retries and migrations as events
    +- pdserve.prefill        the prefill worker: queue, compute, first token
    +- pdserve.kv_transfer    the KV transfer: transport, bytes, hidden vs exposed part,
    |                         the receiver's staging (recorded by the decode worker from
    |                         the transfer's own timestamps, so the transport needs no
    |                         tracer)
    +- pdserve.decode         the decode worker: queue, the wait for KV, steps, tokens

Request-level attribute names are vLLM's (`gen_ai.request.id`, `gen_ai.usage.*`,
`gen_ai.latency.*`, as vLLM's own `llm_request` span writes them) and, where the current
OpenTelemetry GenAI conventions name the same thing differently
(`gen_ai.usage.input_tokens`), both are written so dashboards built on either work.
pdserve's own go under `pdserve.*`. Every attribute is listed in docs/observability.md.

Spans are passed explicitly, never made "current": a request's generator yields across
many awaits, and OpenTelemetry's context attach/detach must not straddle them. With
tracing off every helper returns `NULL_SPAN`, whose methods do nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.errors import PdserveError
from services.observability import tracing

AttrValue = str | bool | int | float


class Attr:
    """Attribute names (see the module docstring for where they come from)."""

    REQUEST_ID = "gen_ai.request.id"
    OPERATION = "gen_ai.operation.name"
    PROVIDER = "gen_ai.provider.name"
    REQUEST_MODEL = "gen_ai.request.model"
    RESPONSE_MODEL = "gen_ai.response.model"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TEMPERATURE = "gen_ai.request.temperature"
    TOP_P = "gen_ai.request.top_p"
    PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"  # vLLM's name
    INPUT_TOKENS = "gen_ai.usage.input_tokens"  # OpenTelemetry's name
    COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"  # vLLM's name
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"  # OpenTelemetry's name
    CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    TTFT = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    PREFILL_TIME = "gen_ai.latency.time_in_model_prefill"
    DECODE_TIME = "gen_ai.latency.time_in_model_decode"
    ERROR_TYPE = "error.type"
    # the router
    INFLIGHT = "pdserve.router.inflight"
    REJECTION = "pdserve.router.rejection"
    PREFILL_WORKER = "pdserve.route.prefill_worker"
    DECODE_WORKER = "pdserve.route.decode_worker"
    ROUTE_REASON = "pdserve.route.reason"
    DISAGGREGATED = "pdserve.route.disaggregated"
    ATTEMPTS = "pdserve.route.attempts"
    MIGRATIONS = "pdserve.route.migrations"
    # the workers
    ROLE = "pdserve.worker.role"
    WORKER_ID = "pdserve.worker.id"
    EPOCH = "pdserve.worker.epoch"
    DECODE_QUEUE = "pdserve.decode.queue_s"
    KV_WAIT = "pdserve.decode.kv_wait_s"
    STEPS = "pdserve.decode.steps"
    LOCAL_PREFILL = "pdserve.decode.local_prefill"
    # the KV transfer
    KV_TRANSFER_ID = "pdserve.kv.transfer_id"
    KV_TRANSPORT = "pdserve.kv.transport"
    KV_BYTES = "pdserve.kv.bytes"
    KV_CHUNKS = "pdserve.kv.chunks"
    KV_CHECKSUM = "pdserve.kv.checksum_s"
    KV_DURATION = "pdserve.kv.duration_s"
    KV_HIDDEN = "pdserve.kv.hidden_s"
    KV_EXPOSED = "pdserve.kv.exposed_s"
    KV_GBPS = "pdserve.kv.gbps"
    KV_STAGED = "pdserve.kv.staged_s"
    KV_OK = "pdserve.kv.ok"
    KV_ERROR = "pdserve.kv.error"
    KV_SENDER = "pdserve.kv.prefill_worker"
    KV_RECEIVER = "pdserve.kv.decode_worker"


def error_type(error: BaseException) -> str:
    """The status name the caller saw: pdserve's error model, a gRPC error's code, a
    cancellation, or the exception's class."""
    if isinstance(error, PdserveError):
        return error.status.name
    if isinstance(error, grpc.aio.AioRpcError):
        return str(error.code().name)
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    return type(error).__name__


def _ns(wall: float) -> int:
    return int(wall * 1e9)


class SpanHandle:
    """One span of a request, or nothing (`NULL_SPAN`). Methods never raise."""

    __slots__ = ("recording", "span")

    def __init__(self, span: trace.Span | None) -> None:
        self.span = span
        # An unsampled request still has a span (its context travels to the workers,
        # so they do not sample it either) but records nothing: call sites test the
        # handle (`if span:`) before building attributes that only a recording uses.
        self.recording = span is not None and span.is_recording()

    def __bool__(self) -> bool:
        return self.recording

    def set(self, attrs: Mapping[str, AttrValue | list[str] | None]) -> None:
        if self.span is not None and self.recording:
            for key, value in attrs.items():
                if value is not None:
                    self.span.set_attribute(key, value)

    def event(self, name: str, attrs: Mapping[str, AttrValue] | None = None,
              wall: float | None = None) -> None:
        """An event now, or at `wall` (time.time()) when it happened earlier."""
        if self.span is not None and self.recording:
            self.span.add_event(name, dict(attrs or {}),
                                timestamp=None if wall is None else _ns(wall))

    def fail(self, error: BaseException | str, error_type: str = "") -> None:
        """Mark the span failed: `error_type` is the status name the caller got."""
        if self.span is None or not self.recording:
            return
        if isinstance(error, BaseException):
            self.span.record_exception(error)
        self.span.set_attribute(Attr.ERROR_TYPE, error_type or type(error).__name__)
        self.span.set_status(Status(StatusCode.ERROR, str(error)[:500]))

    def end(self, wall: float | None = None) -> None:
        if self.span is not None:
            self.span.end(end_time=None if wall is None else _ns(wall))

    def context(self) -> Context | None:
        return None if self.span is None else trace.set_span_in_context(self.span)

    def headers(self) -> dict[str, str]:
        """W3C headers naming this span as the parent (empty when off)."""
        if self.span is None:
            return {}
        carrier: dict[str, str] = {}
        tracing.PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.span))
        return carrier

    def grpc_metadata(self, extra: tuple[tuple[str, str], ...] = ()
                      ) -> tuple[tuple[str, str], ...] | None:
        """Metadata for an outgoing gRPC call so the callee's span is this span's child;
        None (the call's default) when there is nothing to send."""
        if self.span is None:
            return extra or None
        return (*extra, *self.headers().items())

    def exemplar(self) -> dict[str, str] | None:
        """A Prometheus exemplar naming this span's trace (`Histogram.observe(v,
        exemplar=...)`), so a dashboard's latency bucket links to a trace of it."""
        if self.span is None or not self.recording:
            return None
        ctx = self.span.get_span_context()
        return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}

    def __enter__(self) -> SpanHandle:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: Any) -> None:
        if error is not None and not isinstance(error, GeneratorExit):
            self.fail(error, error_type(error))
        self.end()


NULL_SPAN = SpanHandle(None)


def start_span(name: str, parent: Context | None, attrs: Mapping[str, AttrValue | None],
               kind: SpanKind = SpanKind.INTERNAL, wall: float | None = None) -> SpanHandle:
    """A span under `parent` (None: a new trace), or NULL_SPAN when tracing is off."""
    t = tracing.tracer()
    if t is None:
        return NULL_SPAN
    span = t.start_span(name, context=parent, kind=kind,
                        attributes={k: v for k, v in attrs.items() if v is not None},
                        start_time=None if wall is None else _ns(wall))
    return SpanHandle(span)


def now() -> float:
    return time.time()
