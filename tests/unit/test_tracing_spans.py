"""The four request spans: what each records, with the SDK's in-memory exporter."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from services.errors import Overloaded
from services.observability.request_spans import (
    NULL_ROUTER,
    TransferFacts,
    decode_span,
    prefill_span,
    record_kv_transfer,
    router_span,
)


def one(memory: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = [s for s in memory.get_finished_spans() if s.name == name]
    assert len(found) == 1, [s.name for s in memory.get_finished_spans()]
    return found[0]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_router_span_admission_pair_retry_migration_and_usage(
        spans: InMemorySpanExporter) -> None:
    span = router_span("req-7", 300, 16, "SmolLM2", None, temperature=0.0, top_p=1.0)
    span.admitted(3)
    span.pair(0, "prefill-a", "decode-a", "prefix")
    span.moved(1, "prefill-a", "prefill", "prefill_before_first_token", 0,
               "prefill worker prefill-a failed: UNAVAILABLE")
    span.pair(1, None, "decode-a", "local_short")
    span.first_token(0.25)
    span.moved(2, "decode-a", "decode", "decode_mid_stream", 9, "stream reset")
    span.finish("length", 16, {"queue_s": 0.01, "prefill_s": 0.2, "decode_s": 1.5,
                               "kv_transfer_s": 0.03}, 1.8, cached_tokens=64)
    span.end()
    s = one(spans, "pdserve.router")
    a = attrs(s)
    assert a["gen_ai.request.id"] == "req-7"
    assert a["gen_ai.usage.prompt_tokens"] == a["gen_ai.usage.input_tokens"] == 300
    assert a["gen_ai.usage.completion_tokens"] == a["gen_ai.usage.output_tokens"] == 16
    assert a["gen_ai.request.max_tokens"] == 16 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.latency.time_to_first_token"] == 0.25
    assert a["gen_ai.latency.time_in_queue"] == 0.01
    assert a["gen_ai.latency.time_in_model_decode"] == 1.5
    assert a["gen_ai.latency.e2e"] == 1.8
    assert a["gen_ai.usage.cache_read.input_tokens"] == 64
    # The last pair wins as attributes; every choice stays as an event.
    assert a["pdserve.route.prefill_worker"] == "" and a["pdserve.route.disaggregated"] is False
    assert a["pdserve.route.reason"] == "local_short" and a["pdserve.route.attempts"] == 2
    assert a["pdserve.route.migrations"] == 2
    names = [e.name for e in s.events]
    assert names == ["admitted", "pair_chosen", "retry", "pair_chosen", "first_token",
                     "migration"]
    retry, migration = dict(s.events[2].attributes or {}), dict(s.events[-1].attributes or {})
    assert retry["pdserve.move.role"] == "prefill" and retry["pdserve.move.tokens_so_far"] == 0
    assert migration["pdserve.move.tokens_so_far"] == 9
    assert migration["pdserve.move.worker"] == "decode-a"
    assert migration["pdserve.move.reason"] == "decode_mid_stream"
    assert s.status.status_code == StatusCode.UNSET


def test_an_error_inside_the_span_marks_it_with_the_callers_status(
        spans: InMemorySpanExporter) -> None:
    with pytest.raises(Overloaded), router_span("r", 5, 4, "m", None) as span:
        span.admitted(1)
        raise Overloaded("every decode worker is at capacity")
    s = one(spans, "pdserve.router")
    assert s.status.status_code == StatusCode.ERROR
    assert attrs(s)["error.type"] == "RESOURCE_EXHAUSTED"
    assert [e.name for e in s.events] == ["admitted", "exception"]


def test_exemplar_names_the_trace_for_latency_histograms(spans: InMemorySpanExporter) -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

    span = router_span("r", 5, 4, "m", None)
    exemplar = span.exemplar()
    assert exemplar is not None and len(exemplar["trace_id"]) == 32
    reg = CollectorRegistry()
    Histogram("ttft_seconds", "", registry=reg).observe(0.3, exemplar=exemplar)
    assert exemplar["trace_id"] in openmetrics(reg).decode()
    assert b"trace_id" not in generate_latest(reg)  # the classic text format has none
    span.end()
    assert NULL_ROUTER.exemplar() is None


def test_rejection_is_recorded_with_its_reason(spans: InMemorySpanExporter) -> None:
    span = router_span("r", 5, 4, "m", None)
    span.rejected("client 'a' has 2 requests in flight; retry in 500 ms")
    span.end()
    a = attrs(one(spans, "pdserve.router"))
    assert a["pdserve.router.rejection"].startswith("client 'a' has 2")
    assert a["error.type"] == "RESOURCE_EXHAUSTED"


def test_prefill_and_decode_spans_are_children_with_their_anatomy(
        spans: InMemorySpanExporter) -> None:
    root = router_span("r", 100, 8, "m", None)
    p = prefill_span("r", 100, "prefill-a", 2, root.context())
    p.done(queue_s=0.05, prefill_s=0.2, cached_tokens=32, first_token_wall=1000.3,
           started_wall=1000.0)
    p.end()
    d = decode_span("r", 100, "decode-a", 5, root.context(), local_prefill=False)
    d.done(queue_s=0.04, kv_wait_s=0.01, steps=7, completion_tokens=7, finish_reason="length",
           decode_s=0.3)
    d.end()
    root.end()
    r, ps, ds = (one(spans, n) for n in ("pdserve.router", "pdserve.prefill", "pdserve.decode"))
    assert ps.parent is not None and ds.parent is not None
    assert ps.parent.span_id == ds.parent.span_id == r.context.span_id
    pa, da = attrs(ps), attrs(ds)
    assert pa["pdserve.worker.role"] == "prefill" and pa["pdserve.worker.id"] == "prefill-a"
    assert pa["gen_ai.latency.time_in_queue"] == 0.05
    assert pa["gen_ai.latency.time_in_model_prefill"] == 0.2
    assert pa["gen_ai.latency.time_to_first_token"] == pytest.approx(0.3)
    assert pa["gen_ai.usage.cache_read.input_tokens"] == 32
    assert [(e.name, e.timestamp) for e in ps.events] == [
        ("scheduled", int(1000.05 * 1e9)), ("first_token", int(1000.3 * 1e9))]
    assert da["pdserve.decode.steps"] == 7 and da["gen_ai.usage.completion_tokens"] == 7
    assert da["pdserve.decode.queue_s"] == 0.04 and da["pdserve.decode.kv_wait_s"] == 0.01
    assert da["pdserve.decode.local_prefill"] is False and da["pdserve.worker.epoch"] == 5


def test_kv_transfer_span_spans_the_transfer_and_splits_hidden_from_exposed(
        spans: InMemorySpanExporter) -> None:
    root = router_span("r", 100, 8, "m", None)
    facts = TransferFacts("t-1", "grpc", True, nbytes=3_000_000, first_byte_wall=1000.10,
                          last_byte_wall=1000.16, hidden_s=0.04, prefill_worker="prefill-a",
                          decode_worker="decode-a", staged_s=0.002)
    record_kv_transfer(root.context(), facts)
    root.end()
    kv = one(spans, "pdserve.kv_transfer")
    assert kv.parent is not None and kv.parent.span_id == one(
        spans, "pdserve.router").context.span_id
    assert (kv.start_time, kv.end_time) == (int(1000.10 * 1e9), int(1000.16 * 1e9))
    a = attrs(kv)
    assert a["pdserve.kv.bytes"] == 3_000_000 and a["pdserve.kv.transport"] == "grpc"
    assert a["pdserve.kv.duration_s"] == pytest.approx(0.06)
    assert a["pdserve.kv.hidden_s"] == 0.04
    assert a["pdserve.kv.exposed_s"] == pytest.approx(0.02)
    assert a["pdserve.kv.gbps"] == pytest.approx(0.05)
    assert a["pdserve.kv.staged_s"] == 0.002 and a["pdserve.kv.ok"] is True
    assert "pdserve.kv.chunks" not in a  # unknown figures are left out, never zeroed
    assert [e.name for e in kv.events] == ["staged"]


def test_a_failed_transfer_is_an_error_span(spans: InMemorySpanExporter) -> None:
    record_kv_transfer(None, TransferFacts("t-2", "torch", False, error="no complete KV "
                                           "after 30 s"), fallback_wall=2000.0)
    kv = one(spans, "pdserve.kv_transfer")
    assert kv.status.status_code == StatusCode.ERROR
    a = attrs(kv)
    assert a["pdserve.kv.ok"] is False and a["pdserve.kv.error"].startswith("no complete KV")
    assert a["error.type"] == "KV_TRANSFER_FAILED" and "pdserve.kv.bytes" not in a
    assert kv.start_time == kv.end_time == int(2000.0 * 1e9)
