"""Metric math over request records: no I/O, no clocks.

Definitions (docs: conventions.md, "Latency metrics"):

- TTFT: request sent -> first chunk received.
- TPOT, per request: (E2E - TTFT) / (output_tokens - 1); one-token outputs are left out.
- ITL: every gap between successive received chunks, over all requests. (AIPerf calls
  the per-request mean "ITL" and this per-chunk gap "ICL".)
- E2E: request sent -> final message.
- Throughput: completed requests (or tokens) over the measured window, which runs from
  the first measured send to the last measured end.
- Goodput: requests per second that meet *all* given SLOs (DistServe). Bounds are
  inclusive; failed requests never count; a TPOT bound does not apply to one-token
  outputs (they have no TPOT); the ITL bound applies to the request's largest gap.

Statistics are numpy's: linear-interpolated percentiles and population std. Warm-up
requests are left out of everything.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.bench.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)

# The anatomy of a request, in the order its parts happen. The parts add up to the
# client's E2E exactly; "other" parts are what the server's fields do not name.
ANATOMY_SEGMENTS = (
    "router_queue",  # waiting in the router
    "prefill_queue",  # waiting in the prefill engine
    "prefill",  # prefill compute, up to the first token
    "first_token_other",  # server TTFT not covered by the three above
    "kv_transfer",  # KV transfer not hidden behind prefill compute
    "decode_queue",  # waiting for the first decode step
    "decode",  # decode steps: server decode time less the two above
    "server_other",  # server E2E after the last token (finishing, final message)
    "client_network",  # client E2E less server E2E: network, serialization, client
)


@dataclass(slots=True, frozen=True)
class SLOs:
    """Per-request latency bounds in seconds; None means no bound."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: float | None = None  # bound on the request's largest chunk gap
    e2e_s: float | None = None

    def as_dict(self) -> dict[str, float]:
        pairs = (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("itl", self.itl_s),
                 ("e2e", self.e2e_s))
        return {k: v for k, v in pairs if v is not None}

    def met(self, rec: RequestRecord) -> bool:
        if not rec.ok:
            return False
        checks = (
            (self.ttft_s, rec.ttft_s),
            (self.tpot_s, tpot(rec)),
            (self.itl_s, max(itls(rec), default=None)),
            (self.e2e_s, rec.e2e_s),
        )
        return all(bound is None or value is None or value <= bound for bound, value in checks)


def output_tokens(rec: RequestRecord) -> int:
    """Completion tokens: the server's usage, else the tokens or chunks counted."""
    return rec.output_tokens or sum(rec.chunk_tokens) or len(rec.chunk_offsets)


def tpot(rec: RequestRecord) -> float | None:
    n = output_tokens(rec)
    if not rec.ok or n < 2 or rec.e2e_s is None or rec.ttft_s is None:
        return None
    return (rec.e2e_s - rec.ttft_s) / (n - 1)


def itls(rec: RequestRecord) -> list[float]:
    offsets = rec.chunk_offsets
    return [b - a for a, b in itertools.pairwise(offsets)]


def stats(values: list[float] | np.ndarray) -> dict[str, float | int | None]:
    """count, mean, std, min, p50..p99, max; None for all but count when empty."""
    arr = np.asarray(values, dtype=float)
    keys = ["mean", "std", "min", *(f"p{p}" for p in PERCENTILES), "max"]
    if arr.size == 0:
        return {"count": 0, **dict.fromkeys(keys)}
    pct = np.percentile(arr, PERCENTILES)
    numbers = [arr.mean(), arr.std(), arr.min(), *pct, arr.max()]
    return {"count": int(arr.size), **{k: float(v) for k, v in zip(keys, numbers, strict=True)}}


def anatomy(rec: RequestRecord) -> dict[str, float] | None:
    """Where the request's client E2E went, per ``ANATOMY_SEGMENTS``; None without
    server timings. Residuals are kept signed so the parts sum to the E2E exactly."""
    t = rec.server
    if t is None or not rec.ok or rec.e2e_s is None:
        return None
    kv_exposed = max(0.0, t.kv_transfer_s - t.kv_transfer_hidden_s)
    parts = {
        "router_queue": t.router_queue_s,
        "prefill_queue": t.queue_s,
        "prefill": t.prefill_s,
        "first_token_other": t.ttft_s - t.router_queue_s - t.queue_s - t.prefill_s,
        "kv_transfer": kv_exposed,
        "decode_queue": t.decode_queue_s,
        "decode": t.decode_s - kv_exposed - t.decode_queue_s,
        "server_other": t.e2e_s - t.ttft_s - t.decode_s,
        "client_network": rec.e2e_s - t.e2e_s,
    }
    return parts


def anatomy_summary(records: list[RequestRecord]) -> dict[str, Any] | None:
    rows = [(r, a) for r in records if (a := anatomy(r)) is not None]
    if not rows:
        return None
    out: dict[str, Any] = {seg: stats([a[seg] for _, a in rows]) for seg in ANATOMY_SEGMENTS}
    servers = [r.server for r, _ in rows if r.server is not None]
    out["kv_transfer_bytes"] = stats([s.kv_transfer_bytes for s in servers])
    out["kv_transfer_total_s"] = stats([s.kv_transfer_s for s in servers])
    out["kv_transfer_hidden_s"] = stats([s.kv_transfer_hidden_s for s in servers])
    out["server_e2e"] = stats([s.e2e_s for s in servers])
    out["requests"] = len(rows)
    return out


def window(records: list[RequestRecord]) -> float:
    """Seconds from the first send to the last end, over the given records."""
    if not records:
        return 0.0
    start = min(r.send_time for r in records)
    end = max(r.send_time + (r.e2e_s or 0.0) for r in records)
    return end - start


def latency_stats(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    return {
        "ttft_s": stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": stats([t for r in ok if (t := tpot(r)) is not None]),
        "itl_s": stats([gap for r in ok for gap in itls(r)]),
        "e2e_s": stats([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


def summarize(records: list[RequestRecord], slos: SLOs | None = None) -> dict[str, Any]:
    """The JSON-ready summary of one run (warm-up left out)."""
    slos = slos or SLOs()
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    duration = window(measured)
    out_tokens = sum(output_tokens(r) for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = sum(1 for r in measured if slos.met(r))

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    kinds = sorted({r.kind for r in measured})
    return {
        "requests": len(measured),
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "warmup_requests": len(records) - len(measured),
        "errors": dict(Counter(r.error_code for r in measured if not r.ok).most_common()),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "slos": slos.as_dict(),
        "good_requests": good,
        "goodput": per_s(good),
        "goodput_share": good / len(measured) if measured else 0.0,
        **latency_stats(measured),
        "by_kind": ({k: latency_stats([r for r in measured if r.kind == k]) for k in kinds}
                    if len(kinds) > 1 else {}),
        "anatomy": anatomy_summary(measured),
    }
