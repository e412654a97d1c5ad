"""Tracing setup and W3C context propagation: off by default, the standard OTEL_*
variables, and a trace that crosses a real gRPC call and reaches a real OTLP receiver."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from starlette.datastructures import Headers

from services.observability import tracing
from services.observability.request_spans import (
    NULL_ROUTER,
    TransferFacts,
    decode_span,
    prefill_span,
    record_kv_transfer,
    router_span,
)
from services.observability.spans import NULL_SPAN, start_span
from tests.helpers.otlp_receiver import OtlpReceiver

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SAMPLED = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"
UNSAMPLED = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-00"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER",
                 "OTEL_TRACES_SAMPLER_ARG", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    yield
    tracing.shutdown_tracing()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def test_off_by_default_and_every_helper_is_inert() -> None:
    assert tracing.setup_tracing("pdserve-router") is False
    assert not tracing.enabled()
    assert tracing.extract_grpc([("traceparent", SAMPLED)]) is None
    assert tracing.extract_http({"traceparent": SAMPLED}) is None
    span = router_span("r1", 10, 5, "m", None)
    assert span is NULL_ROUTER and not span
    span.admitted(1)
    span.pair(0, "p", "d", "load")
    span.finish("stop", 3, {"queue_s": 0.1}, 1.0)
    assert span.headers() == {}
    assert span.grpc_metadata() is None
    assert span.grpc_metadata((("x-client-id", "a"),)) == (("x-client-id", "a"),)
    assert start_span("x", None, {}) is NULL_SPAN
    record_kv_transfer(None, TransferFacts("t", "grpc", True, 10, 1.0, 2.0))
    with prefill_span("r1", 10, "w", 1, None) as p:
        p.done(0.1, 0.2, 0, 2.0, 1.0)
    d = decode_span("r1", 10, "w", 1, None, local_prefill=False)
    d.done(0.1, 0.0, 3, 3, "stop", 0.5)
    assert not d and d is decode_span("r2", 10, "w", 1, None, local_prefill=True)


@pytest.mark.parametrize(("env", "flag", "expected"), [
    ({}, None, ""),
    ({}, "127.0.0.1:4317", "http://127.0.0.1:4317"),
    ({}, "localhost:4317", "http://localhost:4317"),
    ({}, "collector.observability:4317", "https://collector.observability:4317"),
    ({}, "http://collector:4317", "http://collector:4317"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317"}, None, "http://a:4317"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317",
      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4317"}, None, "http://b:4317"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4317"}, "http://c:1", "http://c:1"),
    ({"OTEL_SDK_DISABLED": "true"}, "http://c:1", ""),
    ({"OTEL_TRACES_EXPORTER": "none"}, "http://c:1", ""),
])
def test_endpoint_from_flag_and_standard_variables(env: dict[str, str], flag: str | None,
                                                   expected: str) -> None:
    assert tracing.resolve_endpoint(flag, env) == expected


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_bad_ratio_is_refused_with_its_name(ratio: float) -> None:
    with pytest.raises(ValueError, match="otlp_sampling_ratio"):
        tracing.setup_tracing("x", "http://127.0.0.1:1", ratio)


def test_http_headers_extracted_case_insensitively() -> None:
    tracing.setup_tracing("pdserve-router", None, 1.0, exporter=_memory())
    ctx = tracing.extract_http(Headers({"TraceParent": SAMPLED}))
    span = start_span("s", ctx, {})
    assert format(span.span.get_span_context().trace_id, "032x") == CLIENT_TRACE  # type: ignore[union-attr]
    assert tracing.extract_http(Headers({"content-type": "x"})) is None


def _memory():  # type: ignore[no-untyped-def]
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    return InMemorySpanExporter()


async def test_trace_crosses_a_real_grpc_call_and_reaches_the_receiver(
        receiver: OtlpReceiver) -> None:
    """Router span -> traceparent in gRPC metadata -> a real grpc.aio server extracts it
    -> the worker's span is the router span's child, in the same trace; both exported
    over OTLP/gRPC to the receiver."""
    receiver.clear()
    assert tracing.setup_tracing("pdserve-test", receiver.endpoint, 1.0)

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        parent = tracing.extract_grpc(context.invocation_metadata())
        with prefill_span("req-1", 7, "prefill-a", 3, parent) as span:
            span.done(0.01, 0.02, 0, 2.0, 1.0)
        return request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
        "Call": grpc.unary_unary_rpc_method_handler(handler)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        root = router_span("req-1", 7, 4, "m", tracing.extract_grpc([("traceparent", SAMPLED)]))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.T/Call")
            assert await call(b"x", metadata=root.grpc_metadata((("x-client-id", "c"),))) == b"x"
        root.end()
    finally:
        await server.stop(None)
    assert tracing.force_flush()
    spans = {s.name: s for s in receiver.wait_for({"pdserve.router", "pdserve.prefill"})}
    router, prefill = spans["pdserve.router"], spans["pdserve.prefill"]
    assert router.trace_id == prefill.trace_id == CLIENT_TRACE  # the client's trace
    assert router.parent_span_id == "00f067aa0ba902b7"
    assert prefill.parent_span_id == router.span_id
    assert prefill.service == "pdserve-test"
    assert prefill.attributes["gen_ai.request.id"] == "req-1"
    assert prefill.attributes["pdserve.worker.epoch"] == 3


def test_sampling_ratio_zero_exports_nothing_unless_the_client_sampled_it(
        receiver: OtlpReceiver) -> None:
    receiver.clear()
    tracing.setup_tracing("pdserve-test", receiver.endpoint, 0.0)
    for parent in (None, tracing.extract_grpc([("traceparent", UNSAMPLED)])):
        root = router_span("quiet", 7, 4, "m", parent)
        child = prefill_span("quiet", 7, "p", 1, tracing.extract_grpc(
            list(root.grpc_metadata() or ())))
        child.end()
        root.end()
    # A client that asks for its request to be traced (sampled flag) is followed, so the
    # exporter demonstrably works in this setup: only that trace arrives.
    router_span("asked", 7, 4, "m", tracing.extract_grpc([("traceparent", SAMPLED)])).end()
    tracing.shutdown_tracing()  # flushes: whatever was queued has been sent now
    assert [(s.name, s.trace_id, s.attributes["gen_ai.request.id"]) for s in receiver.spans] \
        == [("pdserve.router", CLIENT_TRACE, "asked")]


def test_an_unsampled_span_records_nothing_but_still_carries_its_context() -> None:
    memory = _memory()
    tracing.setup_tracing("pdserve-router", None, 0.0, exporter=memory)
    root = router_span("r", 7, 4, "m", None)
    assert not root  # call sites skip building attributes
    md = dict(root.grpc_metadata() or ())
    flags = int(md["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 1 == 0  # "not sampled" reaches the workers
    root.end()
    assert memory.get_finished_spans() == ()


def test_without_traceparent_each_request_starts_its_own_trace() -> None:
    memory = _memory()
    tracing.setup_tracing("pdserve-router", None, 1.0, exporter=memory)
    for i in range(3):
        router_span(f"r{i}", 7, 4, "m", tracing.extract_grpc([])).end()
    spans = memory.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 3
    assert all(s.parent is None for s in spans)


def test_standard_sampler_variable_applies_when_no_ratio_is_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    memory = _memory()
    tracing.setup_tracing("pdserve-router", None, None, exporter=memory)
    router_span("r", 7, 4, "m", tracing.extract_grpc([("traceparent", SAMPLED)])).end()
    assert memory.get_finished_spans() == ()


def test_service_name_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-router")
    memory = _memory()
    tracing.setup_tracing("pdserve-router", None, 1.0, exporter=memory, instance_id="r-1")
    router_span("r", 7, 4, "m", None).end()
    (span,) = memory.get_finished_spans()
    assert span.resource.attributes["service.name"] == "llm-router"
    assert span.resource.attributes["service.instance.id"] == "r-1"


@pytest.mark.parametrize("value", ["garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01",
                                   "ff-" + CLIENT_TRACE + "-00f067aa0ba902b7-01", "x" * 10000])
def test_a_malformed_traceparent_starts_a_new_trace(value: str) -> None:
    memory = _memory()
    tracing.setup_tracing("pdserve-router", None, 1.0, exporter=memory)
    headers = tracing.carried([("traceparent", value), ("x-client-id", "a")])
    router_span("r", 7, 4, "m", tracing.extract_grpc(headers)).end()
    (span,) = memory.get_finished_spans()
    assert span.parent is None
