"""What happens to one request in the router, and who hears of it.

The router tells a `RequestEvents` (one per request, made when the request arrives)
each step of its life: admitted or rejected, the pair chosen, the first token, a move
to another worker, finished or failed, and its end. Listeners turn those steps into the
router's span (`RouterSpan`), its Prometheus metrics and the timing anatomy of the
answer, so the router's own code reads as the request's control flow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from services.errors import WorkerFailure
from services.messages import Delta, GenerationRequest
from services.observability import tracing
from services.observability.request_spans import RouterSpan, router_span
from services.observability.spans import error_type
from services.router.policies import Choice

log = logging.getLogger(__name__)

INFLIGHT = Gauge("pdserve_router_inflight", "requests in flight in this router")
PAIR_CHOICES = Counter("pdserve_router_pair_choices", "pairs chosen, by reason", ["reason"])
DISAGG = Counter("pdserve_router_disaggregation_decisions",
                 "conditional disaggregation: prefill on a prefill worker or locally",
                 ["decision"])
REJECTIONS = Counter("pdserve_router_rejections", "requests refused at admission", ["reason"])
TTFT = Histogram("pdserve_router_time_to_first_token_seconds", "router-side TTFT",
                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40))
WORKER_REQUESTS = Counter("pdserve_router_worker_requests", "requests sent to each worker",
                          ["worker", "role"])
MIGRATIONS = Counter("pdserve_migrations", "requests moved to another worker after the one "
                     "serving them failed, by when (reason) and the worker that failed",
                     ["reason", "worker"])
E2E = Histogram("pdserve_router_e2e_request_latency_seconds", "router-side request latency",
                buckets=(0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80))

_CHILDREN: dict[tuple[object, ...], Any] = {}


def _child(metric: Counter, *labels: str) -> Any:
    """`metric.labels(*labels)`, looked up once: `labels()` takes a lock and builds the
    key on every call, which the per-request path pays several times."""
    key = (metric, *labels)
    child = _CHILDREN.get(key)
    if child is None:
        child = _CHILDREN[key] = metric.labels(*labels)
    return child


@dataclass(frozen=True, slots=True)
class Move:
    """A worker failed and the request goes to another one (the next pair chosen)."""

    number: int  # the how-manyth move of this request
    worker: str  # the worker that failed
    role: str  # its role: "prefill" or "decode"
    reason: str  # "<role>_before_first_token" or "<role>_mid_stream"
    tokens_so_far: int  # tokens the client had received
    error: str  # the failure, as the router saw it


class RequestListener:
    """Hears the steps of one request; each method does nothing unless overridden.
    Times are seconds since the request arrived. Methods must not raise."""

    __slots__ = ()

    def admitted(self, inflight: int) -> None:
        """Let in; `inflight`: requests in flight in this router, this one included."""

    def rejected(self, reason: str, message: str) -> None:
        """Refused for lack of capacity (`reason` as in `pdserve_router_rejections`)."""

    def pair_chosen(self, attempt: int, choice: Choice, at_s: float) -> None:
        """The pair of the `attempt`th try (0 = the first), handed its request now."""

    def first_token(self, ttft_s: float, exemplar: dict[str, str] | None) -> None:
        """Token 1 goes to the client; `exemplar` names the request's trace, if any."""

    def moved(self, move: Move) -> None:
        """A worker failed; the request goes on elsewhere."""

    def finished(self, final: Delta, completion_tokens: int, e2e_s: float) -> None:
        """The final message, before it is sent on (a listener may fill its timings)."""

    def failed(self, error: BaseException) -> None:
        """The request ended with `error` (not a rejection, not the client leaving)."""

    def ended(self, e2e_s: float, inflight: int | None) -> None:
        """The router is done with the request; `inflight`: this router's count after
        it left, None when it was never admitted."""


class RouterMetrics(RequestListener):
    """The router's Prometheus metrics (one instance serves every request)."""

    __slots__ = ()

    def admitted(self, inflight: int) -> None:
        INFLIGHT.set(inflight)

    def rejected(self, reason: str, message: str) -> None:
        _child(REJECTIONS, reason).inc()

    def pair_chosen(self, attempt: int, choice: Choice, at_s: float) -> None:
        _child(PAIR_CHOICES, choice.reason).inc()
        _child(DISAGG, "remote" if choice.prefill else "local").inc()
        for w in (choice.prefill, choice.decode):
            if w is not None:
                _child(WORKER_REQUESTS, w.worker_id, w.role).inc()

    def first_token(self, ttft_s: float, exemplar: dict[str, str] | None) -> None:
        TTFT.observe(ttft_s, exemplar=exemplar)

    def moved(self, move: Move) -> None:
        _child(MIGRATIONS, move.reason, move.worker).inc()

    def ended(self, e2e_s: float, inflight: int | None) -> None:
        if inflight is not None:
            INFLIGHT.set(inflight)
            E2E.observe(e2e_s)


ROUTER_METRICS = RouterMetrics()


class SpanListener(RequestListener):
    """Writes the steps onto the request's `pdserve.router` span."""

    __slots__ = ("span",)

    def __init__(self, span: RouterSpan) -> None:
        self.span = span

    def admitted(self, inflight: int) -> None:
        self.span.admitted(inflight)

    def rejected(self, reason: str, message: str) -> None:
        self.span.rejected(message)

    def pair_chosen(self, attempt: int, choice: Choice, at_s: float) -> None:
        self.span.pair(attempt, choice.prefill.worker_id if choice.prefill else None,
                       choice.decode.worker_id, choice.reason)

    def first_token(self, ttft_s: float, exemplar: dict[str, str] | None) -> None:
        self.span.first_token(ttft_s)

    def moved(self, move: Move) -> None:
        self.span.moved(move.number, move.worker, move.role, move.reason, move.tokens_so_far,
                        move.error)

    def finished(self, final: Delta, completion_tokens: int, e2e_s: float) -> None:
        if self.span:  # the timings' dict is built only for a recording span
            self.span.finish(final.finish_reason, completion_tokens, asdict(final.timings),
                             e2e_s, final.num_cached_tokens)

    def failed(self, error: BaseException) -> None:
        self.span.fail(error, error_type(error))

    def ended(self, e2e_s: float, inflight: int | None) -> None:
        self.span.end()


class TimingAnatomy(RequestListener):
    """The router's part of the answer's `Timings`: `router_queue_s`, arrival to the
    hand-over of the last pair."""

    __slots__ = ("router_queue_s",)

    def __init__(self) -> None:
        self.router_queue_s = 0.0

    def pair_chosen(self, attempt: int, choice: Choice, at_s: float) -> None:
        self.router_queue_s = at_s

    def finished(self, final: Delta, completion_tokens: int, e2e_s: float) -> None:
        final.timings.router_queue_s = self.router_queue_s


class RequestEvents:
    """One request's steps, told to its listeners. The first outcome told (rejected,
    finished or failed) is the request's: a later `failed` (the exception a rejection
    raises on its way out) is not told again."""

    __slots__ = ("_clock", "_listeners", "_outcome", "_started", "request_id", "span")

    def __init__(self, request_id: str, span: RouterSpan, listeners: Sequence[RequestListener],
                 started: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.request_id = request_id
        self.span = span  # its context goes with the calls to workers
        self._listeners = tuple(listeners)
        self._started = started  # clock() when the request arrived
        self._clock = clock
        self._outcome = ""

    def _since(self) -> float:
        return self._clock() - self._started

    def grpc_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Metadata for the calls to workers, so their spans join the request's trace."""
        return self.span.grpc_metadata()

    def admitted(self, inflight: int) -> None:
        for listener in self._listeners:
            listener.admitted(inflight)

    def rejected(self, reason: str, message: str) -> None:
        self._outcome = "rejected"
        for listener in self._listeners:
            listener.rejected(reason, message)

    def pair_chosen(self, attempt: int, choice: Choice) -> None:
        at = self._since()
        for listener in self._listeners:
            listener.pair_chosen(attempt, choice, at)

    def first_token(self) -> None:
        ttft, exemplar = self._since(), self.span.exemplar()
        for listener in self._listeners:
            listener.first_token(ttft, exemplar)

    def moved(self, number: int, failure: WorkerFailure, tokens_so_far: int) -> None:
        when = "mid_stream" if tokens_so_far else "before_first_token"
        move = Move(number, failure.worker_id, failure.role, f"{failure.role}_{when}",
                    tokens_so_far, failure.message)
        log.warning("moving %s after %d tokens (%s): %s", self.request_id, tokens_so_far,
                    move.reason, move.error)
        for listener in self._listeners:
            listener.moved(move)

    def finished(self, final: Delta, completion_tokens: int) -> None:
        self._outcome = "finished"
        e2e = self._since()
        for listener in self._listeners:
            listener.finished(final, completion_tokens, e2e)

    def failed(self, error: BaseException) -> None:
        """`error` ends the request, unless it already had its outcome or the client
        went away (GeneratorExit: nothing failed)."""
        if self._outcome or isinstance(error, GeneratorExit):
            return
        self._outcome = "failed"
        for listener in self._listeners:
            listener.failed(error)

    def ended(self, inflight: int | None = None) -> None:
        e2e = self._since()
        for listener in self._listeners:
            listener.ended(e2e, inflight)


def request_events(req: GenerationRequest, model: str) -> RequestEvents:
    """The events of `req` as it arrives: its span (a child of the client's trace
    context; none when tracing is off), the router's metrics and the timing anatomy."""
    started = time.monotonic()
    span = router_span(req.request_id, len(req.prompt_token_ids), req.max_tokens, model,
                       tracing.extract_grpc(req.trace_headers), req.sampling.temperature,
                       req.sampling.top_p)
    listeners: tuple[RequestListener, ...] = (TimingAnatomy(), ROUTER_METRICS)
    if span.span is not None:
        listeners = (*listeners, SpanListener(span))
    return RequestEvents(req.request_id, span, listeners, started)
