"""A real OTLP/gRPC trace receiver for tests: the collector's `TraceService` (generated
code from opentelemetry-proto) on a loopback port, keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from services.server.channels import free_port


def value_of(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value_of(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Received:
    """One span as the receiver got it, with the service that sent it."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status_code: int
    resource: dict[str, Any] = field(default_factory=dict)


class _Service(tpb_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self.sink = sink

    def Export(self, request: tpb.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> tpb.ExportTraceServiceResponse:
        for rs in request.resource_spans:
            resource = {a.key: value_of(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.sink.add(Received(
                        service=str(resource.get("service.name", "")), name=s.name,
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={a.key: value_of(a.value) for a in s.attributes},
                        events=[(e.name, {a.key: value_of(a.value) for a in e.attributes})
                                for e in s.events],
                        status_code=s.status.code, resource=resource))
        self.sink.exports += 1
        return tpb.ExportTraceServiceResponse()


class OtlpReceiver:
    """Start with `start()`; `endpoint` is what exporters are pointed at."""

    def __init__(self) -> None:
        self.port = free_port()
        self.spans: list[Received] = []
        self.exports = 0
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        tpb_grpc.add_TraceServiceServicer_to_server(_Service(self), self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    def add(self, span: Received) -> None:
        with self._lock:
            self.spans.append(span)

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def by_trace(self) -> dict[str, list[Received]]:
        with self._lock:
            out: dict[str, list[Received]] = {}
            for s in self.spans:
                out.setdefault(s.trace_id, []).append(s)
            return out

    def wait_for(self, names: set[str], timeout_s: float = 60.0,
                 request_id: str = "") -> list[Received]:
        """Spans until one of each name in `names` has arrived (of `request_id` when
        given, matched on gen_ai.request.id or, for the transfer, on its trace); returns
        every span received by then (the test checks what it needs)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            mine = [s for s in spans if not request_id
                    or s.attributes.get("gen_ai.request.id") == request_id]
            traces = {s.trace_id for s in mine}
            seen = {s.name for s in spans if s.trace_id in traces}
            if names <= seen or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)
