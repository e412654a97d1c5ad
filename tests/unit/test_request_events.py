"""A request's events and their listeners, and the background prefix index writer: pure
logic, with a RECORDING listener (a fake that writes down what it hears), a scripted
clock and a FAKE view. No sockets, no Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.errors import FailedCall, Overloaded, WorkerFailure
from services.messages import Delta, GenerationRequest, Sampling
from services.observability.request_spans import NULL_ROUTER
from services.registry.records import WorkerRecord
from services.router.events import (
    Move,
    RequestEvents,
    RequestListener,
    RouterMetrics,
    TimingAnatomy,
    request_events,
)
from services.router.policies import Choice
from services.router.prefix import PrefixHints


class RecordingListener(RequestListener):
    """FAKE listener: every call it hears, in order, with its arguments."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, tuple[Any, ...]]] = []

    def admitted(self, inflight: int) -> None:
        self.heard.append(("admitted", (inflight,)))

    def rejected(self, reason: str, message: str) -> None:
        self.heard.append(("rejected", (reason, message)))

    def pair_chosen(self, attempt: int, choice: Choice, at_s: float) -> None:
        self.heard.append(("pair_chosen", (attempt, choice.reason, at_s)))

    def first_token(self, ttft_s: float, exemplar: dict[str, str] | None) -> None:
        self.heard.append(("first_token", (ttft_s, exemplar)))

    def moved(self, move: Move) -> None:
        self.heard.append(("moved", (move,)))

    def finished(self, final: Delta, completion_tokens: int, e2e_s: float) -> None:
        self.heard.append(("finished", (final.finish_reason, completion_tokens, e2e_s)))

    def failed(self, error: BaseException) -> None:
        self.heard.append(("failed", (type(error).__name__,)))

    def ended(self, e2e_s: float, inflight: int | None) -> None:
        self.heard.append(("ended", (e2e_s, inflight)))

    def names(self) -> list[str]:
        return [name for name, _ in self.heard]


class ScriptedClock:
    """FAKE clock: each reading is one second after the previous."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def worker(worker_id: str, role: str) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, address="127.0.0.1:1", host="h",
                        epoch=1, fingerprint="f")


PAIR = Choice(worker("p", "prefill"), worker("d", "decode"), "load")
LOCAL = Choice(None, worker("d", "decode"), "local_short")


def events_with(*listeners: RequestListener) -> RequestEvents:
    return RequestEvents("r-1", NULL_ROUTER, listeners, started=100.0, clock=ScriptedClock())


def failure(role: str, worker_id: str) -> WorkerFailure:
    return WorkerFailure(FailedCall(role, worker_id, grpc.StatusCode.UNAVAILABLE, "reset"))


def test_a_moved_request_is_told_in_order_with_times_since_arrival() -> None:
    heard, timing = RecordingListener(), TimingAnatomy()
    events = events_with(timing, heard)
    events.admitted(3)
    events.pair_chosen(0, PAIR)  # clock 101: 1 s after arrival
    events.moved(1, failure("prefill", "p"), 0)
    events.pair_chosen(1, LOCAL)  # 102
    events.first_token()  # 103
    events.moved(2, failure("decode", "d"), 5)
    final = Delta([7], "x", finished=True, finish_reason="length")
    events.finished(final, 9)  # 104
    events.failed(GeneratorExit())  # the client left after the end: nothing failed
    events.ended(2)  # 105
    assert heard.names() == ["admitted", "pair_chosen", "moved", "pair_chosen",
                             "first_token", "moved", "finished", "ended"]
    assert heard.heard[1][1] == (0, "load", 1.0)
    assert heard.heard[4][1] == (3.0, None)  # no span: no exemplar
    retry, migration = heard.heard[2][1][0], heard.heard[5][1][0]
    assert (retry.number, retry.worker, retry.role, retry.reason, retry.tokens_so_far) == (
        1, "p", "prefill", "prefill_before_first_token", 0)
    assert migration.reason == "decode_mid_stream" and migration.tokens_so_far == 5
    assert "reset" in migration.error
    assert heard.heard[6][1] == ("length", 9, 4.0)
    assert heard.heard[7][1] == (5.0, 2)
    # The timing anatomy: arrival to the hand-over of the last pair.
    assert final.timings.router_queue_s == 2.0


def test_a_rejection_is_the_outcome_and_its_exception_is_not_a_second_one() -> None:
    heard = RecordingListener()
    events = events_with(heard)
    events.rejected("client_limit", "client 'c' has 1 requests in flight")
    events.failed(Overloaded("client 'c' has 1 requests in flight"))
    events.ended()
    assert heard.names() == ["rejected", "ended"]
    assert heard.heard[-1][1][1] is None  # never admitted


def test_a_failure_is_told_once_and_the_client_leaving_is_not_one() -> None:
    heard = RecordingListener()
    events = events_with(heard)
    events.admitted(1)
    events.failed(failure("decode", "d"))
    events.failed(RuntimeError("after the outcome"))
    events.ended(0)
    assert heard.names() == ["admitted", "failed", "ended"]
    assert heard.heard[1][1] == ("WorkerFailure",)
    left = RecordingListener()
    events = events_with(left)
    events.failed(GeneratorExit())
    assert left.names() == []


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_router_metrics_keep_their_names_and_labels() -> None:
    names = [("pdserve_router_pair_choices_total", {"reason": "load"}),
             ("pdserve_router_disaggregation_decisions_total", {"decision": "remote"}),
             ("pdserve_router_worker_requests_total", {"worker": "p", "role": "prefill"}),
             ("pdserve_router_worker_requests_total", {"worker": "d", "role": "decode"}),
             ("pdserve_router_rejections_total", {"reason": "capacity"}),
             ("pdserve_migrations_total", {"reason": "decode_mid_stream", "worker": "d"}),
             ("pdserve_router_time_to_first_token_seconds_count", {}),
             ("pdserve_router_e2e_request_latency_seconds_count", {})]
    before = [sample(n, **labels) for n, labels in names]
    events = events_with(RouterMetrics())
    events.admitted(4)
    assert sample("pdserve_router_inflight") == 4
    events.pair_chosen(0, PAIR)
    events.first_token()
    events.moved(1, failure("decode", "d"), 3)
    events.rejected("capacity", "every decode worker is at capacity")
    events.ended(3)
    after = [sample(n, **labels) for n, labels in names]
    assert [b - a for a, b in zip(before, after, strict=True)] == [1] * len(names)
    assert sample("pdserve_router_inflight") == 3


def test_the_span_hears_the_request_with_its_usage_and_anatomy(
        spans: InMemorySpanExporter) -> None:
    req = GenerationRequest("req-9", [1, 2, 3, 4], Sampling(temperature=0.0), 8)
    events = request_events(req, "m")
    assert events.grpc_metadata()  # the trace context goes to the workers
    events.admitted(1)
    events.pair_chosen(0, PAIR)
    events.moved(1, failure("decode", "d"), 2)
    events.pair_chosen(1, LOCAL)
    events.first_token()
    final = Delta([5], "x", finished=True, finish_reason="stop", num_cached_tokens=2)
    final.timings.decode_s = 0.5
    events.finished(final, 6)
    events.ended(0)
    [span] = spans.get_finished_spans()
    assert span.name == "pdserve.router"
    assert [e.name for e in span.events] == ["admitted", "pair_chosen", "migration",
                                             "pair_chosen", "first_token"]
    a = dict(span.attributes or {})
    assert a["gen_ai.usage.completion_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    assert a["gen_ai.latency.time_in_model_decode"] == 0.5
    assert a["gen_ai.usage.cache_read.input_tokens"] == 2
    assert a["pdserve.route.attempts"] == 2 and a["pdserve.route.migrations"] == 1
    assert final.timings.router_queue_s > 0


def test_a_rejected_span_says_why(spans: InMemorySpanExporter) -> None:
    events = request_events(GenerationRequest("r", [1], Sampling(), 4), "m")
    events.rejected("router_queue", "router has 2 requests in flight; retry in 500 ms")
    events.failed(Overloaded("router has 2 requests in flight"))
    events.ended()
    [span] = spans.get_finished_spans()
    a = dict(span.attributes or {})
    assert a["pdserve.router.rejection"].startswith("router has 2")
    assert a["error.type"] == "RESOURCE_EXHAUSTED"


class StallingView:
    """FAKE view: each prefix write waits for `release`, or fails when `error` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.error: Exception | None = None
        self.written: list[tuple[str, list[str]]] = []

    async def record_prefix(self, worker_id: str, block_hashes: Sequence[str]) -> None:
        if self.error is not None:
            raise self.error
        await self.release.wait()
        self.written.append((worker_id, list(block_hashes)))


async def test_prefix_hints_are_written_in_the_background_and_bounded() -> None:
    view = StallingView()
    hints = PrefixHints(view, max_pending=2)  # type: ignore[arg-type]
    dropped = sample("pdserve_router_prefix_hints_dropped_total", reason="backlog")
    hints.record("p", ["a"])  # returns at once though the write stalls
    hints.record("p", ["b"])
    hints.record("p", ["c"])  # a third while two stall: dropped and counted
    assert hints.pending == 2
    assert sample("pdserve_router_prefix_hints_dropped_total", reason="backlog") == dropped + 1
    view.release.set()
    while hints.pending:
        await asyncio.sleep(0)
    assert view.written == [("p", ["a"]), ("p", ["b"])]


async def test_a_failed_prefix_write_is_logged_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    view = StallingView()
    view.error = ConnectionError("redis went away")
    hints = PrefixHints(view)  # type: ignore[arg-type]
    failed = sample("pdserve_router_prefix_hints_dropped_total", reason="error")
    hints.record("p", ["a"])
    while hints.pending:
        await asyncio.sleep(0)
    assert sample("pdserve_router_prefix_hints_dropped_total", reason="error") == failed + 1
    assert "redis went away" in caplog.text


async def test_close_cancels_the_stalled_writes() -> None:
    view = StallingView()
    hints = PrefixHints(view)  # type: ignore[arg-type]
    hints.record("p", ["a"])
    await asyncio.sleep(0)
    await hints.close()
    assert hints.pending == 0 and view.written == []
