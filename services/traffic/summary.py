"""The summary of a run: statistics over its request records, no I/O, no clocks.

Per-request latencies are defined in ``latency``; over a run:

- Throughput: completed requests (or tokens) over the measured window, which runs from
  the first measured send to the last measured end.
- Goodput: requests per second that meet *all* given SLOs (DistServe); failed requests
  never count.

Statistics are numpy's: linear-interpolated percentiles and population std. Warm-up
requests are left out of everything.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from services.traffic.latency import ANATOMY_SEGMENTS, anatomy, itls, output_tokens, tpot
from services.traffic.record import RequestRecord
from services.traffic.slo import SLOs

PERCENTILES = (50, 90, 95, 99)


def stats(values: list[float] | np.ndarray) -> dict[str, float | int | None]:
    """count, mean, std, min, p50..p99, max; None for all but count when empty."""
    arr = np.asarray(values, dtype=float)
    keys = ["mean", "std", "min", *(f"p{p}" for p in PERCENTILES), "max"]
    if arr.size == 0:
        return {"count": 0, **dict.fromkeys(keys)}
    pct = np.percentile(arr, PERCENTILES)
    numbers = [arr.mean(), arr.std(), arr.min(), *pct, arr.max()]
    return {"count": int(arr.size), **{k: float(v) for k, v in zip(keys, numbers, strict=True)}}


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
