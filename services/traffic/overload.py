"""Whether a run offered more load than the server served: no I/O, no clocks.

Two signs, read from the records alone:

- Falling behind. A request's response time counted from when it was *due* (its
  scheduled send, so a client held back by a concurrency cap counts too) stays level over
  a run the server keeps up with. When arrivals outpace completions, each request waits
  for the backlog ahead of it, and that time grows by (offered / served - 1) seconds per
  second of schedule; the least-squares slope over the schedule therefore estimates the
  share of the offered rate the server served, 1 / (1 + slope).
- Queueing dominates TTFT. With pdserve's server timings: the share of the server's TTFT
  spent waiting in the router and in the prefill engine's queue.

Runs sent all at once (an infinite rate) have no offered rate to fall behind; only the
queue share is judged there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from services.traffic.record import RequestRecord

# Below this share of the offered rate served, the backlog grows for as long as the run
# lasts: the later a request is due, the longer it waits, and the run's latencies measure
# how long it ran rather than the stack. A server that keeps up has a slope that is noise
# around zero; a fifth of the arrivals left over is well clear of that noise.
MIN_SERVED_SHARE = 0.8
# The fitted growth over the run must also exceed the first requests' own response time:
# a wait that grows by less than one request takes is a transient, not a backlog.
MIN_GROWTH_OVER_FIRST = 1.0
# More than half of TTFT spent waiting: TTFT then measures the queue, not the prefill.
MAX_QUEUE_SHARE = 0.5
# Fewer measured requests show no trend.
MIN_REQUESTS = 8
# Requests cancelled at the run's end were still waiting: their time so far is a lower
# bound of their response time, which is what a backlog makes them.
_STILL_WAITING = "CANCELLED_BY_CLIENT"


@dataclass(frozen=True, slots=True)
class Overload:
    """The verdict on one run; ``None`` figures were not measurable."""

    overloaded: bool
    offered_rate: float | None  # requests/s the schedule offered
    served_share: float | None  # share of that rate the server kept up with
    latency_growth_s: float | None  # fitted growth of the response time over the run
    queue_share_of_ttft: float | None  # router + prefill queue over the server's TTFT
    warning: str  # one line for the console; "" when not overloaded

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def judge(records: list[RequestRecord], remedy: str = "lower --rate") -> Overload:
    """The verdict over a run's measured records (warm-up already left out); ``remedy``:
    what the warning tells the user to turn down."""
    trend = _trend(records)
    queue = queue_share(records)
    parts = []
    if trend is not None and trend.behind:
        parts.append(
            f"the server completed about {trend.offered * trend.served:.3g} req/s "
            f"of the {trend.offered:.3g} req/s offered, and each request waited "
            f"longer than the one before (+{trend.growth:.3g} s over the run)"
        )
    if queue is not None and queue > MAX_QUEUE_SHARE:
        parts.append(f"queueing was {100 * queue:.0f}% of the server's TTFT")
    warning = ""
    if parts:
        warning = (
            "warning: the offered load exceeded what the stack served: "
            + "; ".join(parts)
            + f". The latencies measure the backlog: {remedy} or add workers."
        )
    return Overload(
        overloaded=bool(parts),
        offered_rate=None if trend is None else trend.offered,
        served_share=None if trend is None else trend.served,
        latency_growth_s=None if trend is None else trend.growth,
        queue_share_of_ttft=queue,
        warning=warning,
    )


@dataclass(frozen=True, slots=True)
class _Trend:
    offered: float  # requests/s over the schedule
    served: float  # 1 / (1 + slope), 1 when the response time did not grow
    growth: float  # fitted change of the response time from the first due to the last
    first: float  # median response time of the first quarter of the schedule

    @property
    def behind(self) -> bool:
        return self.served < MIN_SERVED_SHARE and self.growth > MIN_GROWTH_OVER_FIRST * self.first


def _trend(records: list[RequestRecord]) -> _Trend | None:
    """How the response time, counted from when each request was due, moved over the
    schedule; None for too few requests or a run sent all at once."""
    waited = [
        r for r in records if r.e2e_s is not None and (r.ok or r.error_code == _STILL_WAITING)
    ]
    if len(waited) < MIN_REQUESTS:
        return None
    due = np.array([r.scheduled_s for r in waited])
    span = float(due.max() - due.min())
    if span <= 0:
        return None
    # The run's start on the wall clock: the earliest request left on time.
    start = min(r.send_time - r.scheduled_s for r in waited)
    response = np.array([r.send_time + (r.e2e_s or 0.0) - start for r in waited]) - due
    slope = float(np.polyfit(due, response, 1)[0])
    first = float(np.median(response[due <= np.quantile(due, 0.25)]))
    return _Trend(
        offered=(len(due) - 1) / span,
        served=1 / (1 + max(slope, 0.0)),
        growth=slope * span,
        first=first,
    )


def queue_share(records: list[RequestRecord]) -> float | None:
    """Time spent in the router's and the prefill engine's queues over the server's
    TTFT, summed over the completed requests with server timings."""
    timed = [r.server for r in records if r.ok and r.server is not None]
    ttft = sum(t.ttft_s for t in timed)
    if not timed or ttft <= 0:
        return None
    return sum(t.router_queue_s + t.queue_s for t in timed) / ttft
