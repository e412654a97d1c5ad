"""The four spans of a request (see `spans` for the tree): one helper per hop, so each
call site is one line and the attribute names live in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from services.observability import tracing
from services.observability.spans import Attr, AttrValue, SpanHandle, start_span

if TYPE_CHECKING:
    from services.kv.params import LoadReport
    from services.messages import Timings

# Names of the Timings fields (the API's message) -> the latency attribute they fill.
_LATENCIES = {"queue_s": Attr.TIME_IN_QUEUE, "prefill_s": Attr.PREFILL_TIME,
              "decode_s": Attr.DECODE_TIME}


def _request_attrs(request_id: str, prompt_tokens: int) -> dict[str, str | int]:
    return {Attr.REQUEST_ID: request_id, Attr.PROMPT_TOKENS: prompt_tokens,
            Attr.INPUT_TOKENS: prompt_tokens}


def _usage(completion_tokens: int, finish_reason: str | None) -> dict[str, int | list[str]]:
    out: dict[str, int | list[str]] = {Attr.COMPLETION_TOKENS: completion_tokens,
                                       Attr.OUTPUT_TOKENS: completion_tokens}
    if finish_reason:
        out[Attr.FINISH_REASONS] = [finish_reason]
    return out


# -- the router -------------------------------------------------------------------------
class RouterSpan(SpanHandle):
    """`pdserve.router`: one per client request, from admission to the last token."""

    __slots__ = ()

    def admitted(self, inflight: int) -> None:
        self.event("admitted", {Attr.INFLIGHT: inflight})

    def rejected(self, message: str) -> None:
        """Refused at admission (in-flight bound, client limit, capacity): why."""
        if self:
            self.set({Attr.REJECTION: message[:300]})
            self.fail(message, "RESOURCE_EXHAUSTED")

    def pair(self, attempt: int, prefill_worker: str | None, decode_worker: str,
             reason: str) -> None:
        """The pair chosen and why (`reason` is the policy's, as in
        `pdserve_router_pair_choices{reason}`); no prefill worker: prefill on decode."""
        if not self:
            return
        attrs: dict[str, AttrValue] = {
            Attr.PREFILL_WORKER: prefill_worker or "", Attr.DECODE_WORKER: decode_worker,
            Attr.ROUTE_REASON: reason, Attr.DISAGGREGATED: prefill_worker is not None,
            Attr.ATTEMPTS: attempt + 1}
        self.set(attrs)
        self.event("pair_chosen", attrs)

    def moved(self, number: int, worker: str, role: str, reason: str, tokens_so_far: int,
              error: str) -> None:
        """`worker` failed and the request goes to another one (the next `pair_chosen`
        event says which): a `retry` event when no token had reached the client yet, a
        `migration` event when the stream continues mid-answer."""
        if not self:
            return
        self.set({Attr.MIGRATIONS: number})
        self.event("migration" if tokens_so_far else "retry", {
            "pdserve.move.number": number, "pdserve.move.worker": worker,
            "pdserve.move.role": role, "pdserve.move.reason": reason,
            "pdserve.move.tokens_so_far": tokens_so_far, "pdserve.move.error": error[:300]})

    def first_token(self, ttft_s: float) -> None:
        if self:
            self.set({Attr.TTFT: ttft_s})
            self.event("first_token")

    def finish(self, finish_reason: str | None, completion_tokens: int,
               timings: Mapping[str, float], e2e_s: float, cached_tokens: int = 0) -> None:
        """The final message's usage and timing anatomy (the `Timings` field names)."""
        if not self:
            return
        attrs: dict[str, int | float | list[str]] = dict(_usage(completion_tokens,
                                                                finish_reason))
        attrs[Attr.E2E] = e2e_s
        attrs[Attr.CACHED_TOKENS] = cached_tokens
        for name, attr in _LATENCIES.items():
            if name in timings:
                attrs[attr] = timings[name]
        self.set(attrs)


def router_span(request_id: str, prompt_tokens: int, max_tokens: int, model: str,
                parent: Context | None, temperature: float | None = None,
                top_p: float | None = None) -> RouterSpan:
    """The router's span; `parent` is the client's trace context (None: a new trace)."""
    if not tracing.enabled():  # before building the attributes: no cost when off
        return NULL_ROUTER
    attrs = {**_request_attrs(request_id, prompt_tokens), Attr.OPERATION: "text_completion",
             Attr.PROVIDER: "pdserve", Attr.REQUEST_MODEL: model,
             Attr.RESPONSE_MODEL: model, Attr.MAX_TOKENS: max_tokens,
             Attr.TEMPERATURE: temperature, Attr.TOP_P: top_p}
    return RouterSpan(start_span("pdserve.router", parent, attrs, SpanKind.SERVER).span)


# -- the workers ------------------------------------------------------------------------
def _worker_attrs(role: str, request_id: str, prompt_tokens: int, worker_id: str,
                  epoch: int) -> dict[str, str | int]:
    return {**_request_attrs(request_id, prompt_tokens), Attr.ROLE: role,
            Attr.WORKER_ID: worker_id, Attr.EPOCH: epoch}


class PrefillSpan(SpanHandle):
    """`pdserve.prefill`: the prefill worker's handling of one `Prefill` call."""

    __slots__ = ()

    def done(self, queue_s: float, prefill_s: float, cached_tokens: int,
             first_token_wall: float, started_wall: float) -> None:
        """vLLM's stamps: `queue_s` waiting to be scheduled, `prefill_s` the compute up to
        the first token, sampled at `first_token_wall`."""
        if not self:
            return
        self.set({Attr.TIME_IN_QUEUE: queue_s, Attr.PREFILL_TIME: prefill_s,
                  Attr.TTFT: first_token_wall - started_wall,
                  Attr.CACHED_TOKENS: cached_tokens})
        self.event("scheduled", wall=min(first_token_wall, started_wall + queue_s))
        self.event("first_token", wall=first_token_wall)


NULL_ROUTER = RouterSpan(None)


def prefill_span(request_id: str, prompt_tokens: int, worker_id: str, epoch: int,
                 parent: Context | None) -> PrefillSpan:
    if not tracing.enabled():
        return NULL_PREFILL
    attrs = _worker_attrs("prefill", request_id, prompt_tokens, worker_id, epoch)
    return PrefillSpan(start_span("pdserve.prefill", parent, attrs, SpanKind.SERVER).span)


NULL_PREFILL = PrefillSpan(None)


class DecodeSpan(SpanHandle):
    """`pdserve.decode`: the decode worker's handling of one `Decode` call."""

    __slots__ = ()

    def done(self, queue_s: float, kv_wait_s: float, steps: int, completion_tokens: int,
             finish_reason: str | None, decode_s: float) -> None:
        """`queue_s`: received -> first step; `kv_wait_s`: the part of it spent waiting
        for the prompt's KV to arrive (0 when it was there first); `steps`: engine
        outputs for this request (one per scheduler step that gave it tokens)."""
        if not self:
            return
        self.set({Attr.DECODE_QUEUE: queue_s, Attr.KV_WAIT: kv_wait_s, Attr.STEPS: steps,
                  Attr.DECODE_TIME: decode_s, **_usage(completion_tokens, finish_reason)})


def decode_span(request_id: str, prompt_tokens: int, worker_id: str, epoch: int,
                parent: Context | None, local_prefill: bool) -> DecodeSpan:
    if not tracing.enabled():
        return NULL_DECODE
    attrs = {**_worker_attrs("decode", request_id, prompt_tokens, worker_id, epoch),
             Attr.LOCAL_PREFILL: local_prefill}
    return DecodeSpan(start_span("pdserve.decode", parent, attrs, SpanKind.SERVER).span)


NULL_DECODE = DecodeSpan(None)


# -- the KV transfer --------------------------------------------------------------------
@dataclass(slots=True)
class TransferFacts:
    """One transfer as the decode worker saw it: its load report (bytes, first and last
    byte, time.time()) and the `Timings` it derived (duration, part hidden behind
    prefill). Optional figures are recorded only when known. Build it only for a
    recording decode span (`if span:`): it is the one costly thing at that call site."""

    transfer_id: str
    transport: str
    ok: bool
    nbytes: int = 0
    first_byte_wall: float = 0.0
    last_byte_wall: float = 0.0
    hidden_s: float = 0.0
    prefill_worker: str = ""
    decode_worker: str = ""
    error: str = ""
    chunks: int | None = None
    checksum_s: float | None = None
    staged_s: float | None = None  # last byte verified -> first decode step that used it

    @property
    def duration_s(self) -> float:
        return max(0.0, self.last_byte_wall - self.first_byte_wall)


def record_kv_transfer(parent: Context | None, facts: TransferFacts,
                       fallback_wall: float = 0.0) -> None:
    """The `pdserve.kv_transfer` span, started and ended at the transfer's own first and
    last byte (a failed transfer without stamps sits at `fallback_wall`). `parent` is
    the context the `Decode` call came with, so the span is the prefill span's sibling."""
    if not tracing.enabled():
        return
    start = facts.first_byte_wall or fallback_wall or None
    attrs: dict[str, AttrValue | None] = {
        Attr.KV_TRANSFER_ID: facts.transfer_id, Attr.KV_TRANSPORT: facts.transport,
        Attr.KV_OK: facts.ok, Attr.KV_SENDER: facts.prefill_worker,
        Attr.KV_RECEIVER: facts.decode_worker}
    span = start_span("pdserve.kv_transfer", parent, attrs, SpanKind.INTERNAL, wall=start)
    if not span:
        return
    duration = facts.duration_s
    if facts.ok:
        span.set({Attr.KV_BYTES: facts.nbytes, Attr.KV_DURATION: duration,
                  Attr.KV_HIDDEN: facts.hidden_s,
                  Attr.KV_EXPOSED: max(0.0, duration - facts.hidden_s),
                  Attr.KV_GBPS: facts.nbytes / duration / 1e9 if duration > 0 else None,
                  Attr.KV_CHUNKS: facts.chunks, Attr.KV_CHECKSUM: facts.checksum_s,
                  Attr.KV_STAGED: facts.staged_s})
        span.event("staged", wall=facts.last_byte_wall or None)
    else:
        span.set({Attr.KV_ERROR: facts.error[:300]})
        span.fail(facts.error or "KV transfer failed", "KV_TRANSFER_FAILED")
    span.end(wall=facts.last_byte_wall or start)


@dataclass(frozen=True, slots=True)
class DecodeTally:
    """What the decode worker counted over one `Decode` call (times are time.time())."""

    received_wall: float  # the call arrived
    first_step_wall: float  # the engine's first output for it (0: none)
    steps: int  # engine outputs for the request
    tokens: int  # tokens it generated
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class KVLoad:
    """The prompt's KV as the decode worker received it: the connector's load `report`
    and the route the transfer took."""

    report: LoadReport
    transport: str
    prefill_worker: str
    decode_worker: str


def finish_decode(span: DecodeSpan, parent: Context | None, tally: DecodeTally,
                  timings: Timings, load: KVLoad | None) -> None:
    """The decode worker's end of a request: its span's figures, and the KV transfer's
    own span from the connector's load report (`load` None: nothing was received).
    `timings` is what the worker answers with."""
    if not span:
        return
    kv_wait = 0.0
    if load is not None:
        report = load.report
        first, last = report.first_byte_wall, report.last_byte_wall
        if report.ok:  # the request could not start before its KV was complete
            kv_wait = max(0.0, last - tally.received_wall)
        staged = tally.first_step_wall - last if report.ok and tally.first_step_wall else None
        record_kv_transfer(parent, TransferFacts(
            report.transfer_id, load.transport, report.ok, report.nbytes, first, last,
            timings.kv_transfer_hidden_s, load.prefill_worker, load.decode_worker,
            report.error, chunks=report.chunks, checksum_s=report.checksum_s,
            staged_s=None if staged is None else max(0.0, staged)),
            fallback_wall=tally.received_wall)
    span.done(timings.decode_queue_s or timings.queue_s, kv_wait, tally.steps, tally.tokens,
              tally.finish_reason, timings.decode_s)
