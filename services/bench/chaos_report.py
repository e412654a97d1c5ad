"""What a fault-injection run and a soak run measured: pure functions over the records
(no I/O but the PNG files), so the analysis is testable without a stack.

Chaos: requests sent, finished, finished token-identical to the undisturbed reference,
errors by status, the longest gap between two tokens a client saw and the fault it
followed, the time from each fault to the first token of the first request sent after
it, migrations, and per fault the requests sent while it lasted and how they ended. Each
stream is clean when it finished token-identical, or ended in one status with only a
prefix of the undisturbed answer received (nothing lost, nothing duplicated). Soak:
growth of every resource series between a point in the run and its end, and whether KV
usage and staged transfers came back to zero after the load.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from services.bench.faults import KINDS, FaultEvent
from services.bench.tokens import Tokens
from services.traffic.record import RequestRecord


def arrivals(rec: RequestRecord) -> list[float]:
    """Epoch receive time of every chunk of a request."""
    return [rec.send_time + o for o in rec.chunk_offsets]


def last_fault(events: Sequence[FaultEvent], t: float) -> FaultEvent | None:
    before = [e for e in events if e.at and e.at <= t]
    return before[-1] if before else None


def longest_gaps(records: Sequence[RequestRecord], events: Sequence[FaultEvent],
                 top: int = 10) -> list[dict[str, Any]]:
    """The longest gaps between two successive chunks of one request, longest first, with
    the fault each followed (the last one injected before the gap ended)."""
    gaps = []
    for rec in records:
        times = arrivals(rec)
        for k in range(1, len(times)):
            gaps.append((times[k] - times[k - 1], rec, times[k - 1], k))
    gaps.sort(key=lambda g: -g[0])
    out = []
    for gap, rec, start, k in gaps[:top]:
        fault = last_fault(events, start + gap)
        out.append({"gap_s": gap, "request_id": rec.request_id, "index": rec.index,
                    "kind": rec.kind, "after_chunk": k, "start": start,
                    "fault": fault.fault.label() if fault else None,
                    "since_fault_s": (start - fault.at) if fault else None})
    return out


def first_served(records: Sequence[RequestRecord], event: FaultEvent) -> dict[str, Any]:
    """The first request sent after a fault: how long from the fault to its first token."""
    after = sorted((r for r in records if r.send_time >= event.at), key=lambda r: r.send_time)
    for rec in after:
        if rec.chunk_offsets:
            return {"request_id": rec.request_id, "sent_after_s": rec.send_time - event.at,
                    "first_token_after_fault_s": rec.send_time + rec.chunk_offsets[0]
                    - event.at, "ok": rec.ok}
    return {"request_id": None, "first_token_after_fault_s": None}


def during(records: Sequence[RequestRecord], event: FaultEvent,
           clean: dict[int, bool]) -> dict[str, Any]:
    """The requests sent while a fault lasted (from its start to the SIGCONT or the
    link's restore; to whole again for a kill): how many, and how they ended."""
    end = event.resumed_at or event.recovered_at
    if not event.at or end is None:
        return {"sent": 0}
    sent = [r for r in records if event.at <= r.send_time <= end]
    return {"sent": len(sent), "finished": sum(r.ok for r in sent),
            "clean": sum(clean.get(r.index, False) for r in sent),
            "errors": dict(Counter(r.error_code for r in sent if not r.ok).most_common())}


def summarize_chaos(records: Sequence[RequestRecord], tokens: dict[int, Tokens],
                    reference: Sequence[Sequence[int]] | None,
                    events: Sequence[FaultEvent]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    per_request = []
    identical = 0
    for rec in records:
        got = tokens.get(rec.index, Tokens())
        ref = list(reference[rec.index]) if reference is not None else None
        same = ref is not None and rec.ok and got.ids == ref
        identical += same
        diverged = None
        if ref is not None and rec.ok and not same:
            pairs = enumerate(zip(got.ids, ref, strict=False))
            diverged = next((k for k, (a, b) in pairs if a != b), min(len(got.ids), len(ref)))
        per_request.append({
            "index": rec.index, "request_id": rec.request_id, "kind": rec.kind,
            "prompt_tokens": rec.prompt_tokens, "max_tokens": rec.max_tokens,
            "send_time": rec.send_time, "ok": rec.ok, "error_code": rec.error_code,
            "error_message": rec.error_message, "tokens": len(got.ids),
            "migrations": got.migrations, "identical": same, "first_divergence": diverged,
            "token_ids": got.ids, "chunk_offsets": rec.chunk_offsets,
            "chunk_tokens": rec.chunk_tokens, "e2e_s": rec.e2e_s})
    gaps = longest_gaps(records, events)
    # Clean: token-identical, or one status after a prefix of the undisturbed answer.
    clean: dict[int, bool] = {}
    for rec in records:
        ids = tokens.get(rec.index, Tokens()).ids
        want = list(reference[rec.index]) if reference is not None else None
        clean[rec.index] = want is not None and (
            (rec.ok and ids == want) or (not rec.ok and ids == want[:len(ids)]))
    return {
        "sent": len(records), "finished": len(ok), "lost": len(records) - len(ok),
        "finished_identical": identical if reference is not None else None,
        "errors": dict(Counter(r.error_code for r in records if not r.ok).most_common()),
        "migrated_requests": sum(1 for p in per_request if p["migrations"]),
        "migrations": sum(p["migrations"] for p in per_request),
        "longest_gap": gaps[0] if gaps else None,
        "longest_gaps": gaps,
        "clean": sum(clean.values()) if reference is not None else None,
        "not_clean": [i for i, ok in clean.items() if reference is not None and not ok],
        "faults": [{**e.to_dict(), "first_served": first_served(records, e),
                    "during": during(records, e, clean)} for e in events],
        "not_identical": [{k: p[k] for k in ("index", "request_id", "kind", "migrations",
                                             "first_divergence", "tokens", "ok")}
                          for p in per_request if p["ok"] and not p["identical"]],
        "failed": [{k: p[k] for k in ("index", "request_id", "kind", "send_time", "error_code",
                                      "error_message", "tokens", "migrations")}
                   for p in per_request if not p["ok"]],
        "requests": per_request,
    }


def _bins(t0: float, t1: float, width: float) -> np.ndarray:
    return np.arange(t0, t1 + width, width)


def timeline_plot(records: Sequence[RequestRecord], tokens: dict[int, Tokens],
                  events: Sequence[FaultEvent], t0: float, path: Path,
                  bin_s: float = 5.0) -> Path:
    """Tokens/s and finished/failed requests over time, faults and migrations marked."""
    ends = [tokens.get(r.index, Tokens()).end_time or r.send_time for r in records]
    t1 = max([*ends, t0 + bin_s])
    edges = _bins(t0, t1, bin_s)
    chunk_t = np.array([t for r in records for t in arrivals(r)])
    chunk_n = np.array([max(n, 1) for r in records for n in (r.chunk_tokens or
                                                                [1] * len(r.chunk_offsets))])
    tok, _ = np.histogram(chunk_t, edges, weights=chunk_n if chunk_n.size else None)
    done, _ = np.histogram([e for r, e in zip(records, ends, strict=True) if r.ok], edges)
    bad, _ = np.histogram([e for r, e in zip(records, ends, strict=True) if not r.ok], edges)
    x = edges[:-1] - t0
    fig = Figure(figsize=(12, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.step(x, tok / bin_s, where="post", label="output tokens/s received")
    bottom.bar(x, done, width=bin_s, align="edge", alpha=0.6, label="finished")
    bottom.bar(x, bad, width=bin_s, align="edge", color="red", label="failed")
    colors = dict(zip(KINDS, (f"C{k}" for k in (3, 1, 4, 2, 5, 6, 7, 8, 9, 0, 3, 1)),
                      strict=True))
    for e in events:
        if not e.at:
            continue
        c = colors.get(e.fault.kind, "k")
        for ax in (top, bottom):
            ax.axvline(e.at - t0, color=c, linestyle="--")
            if e.resumed_at and e.fault.network:  # the fault itself, darker
                ax.axvspan(e.at - t0, e.resumed_at - t0, color=c, alpha=0.2)
            if e.recovered_at:
                ax.axvspan(e.at - t0, e.recovered_at - t0, color=c, alpha=0.08)
        top.annotate(e.fault.label(), (e.at - t0, 1.0), xycoords=("data", "axes fraction"),
                     rotation=90, va="top", ha="right", fontsize="small", color=c)
    moved = []
    for r in records:
        if tokens.get(r.index, Tokens()).migrations and len(r.chunk_offsets) > 1:
            times = arrivals(r)
            k = int(np.argmax(np.diff(times))) + 1
            moved.append(times[k] - t0)
    if moved:
        ymax = max(float(tok.max()) / bin_s, 1.0)
        top.plot(moved, [ymax * 1.02] * len(moved), "v", color="k", markersize=5,
                 label=f"migrated stream resumed ({len(moved)})")
    top.set_ylabel("tokens/s")
    top.set_title("Chaos run: throughput, failures, faults (dashed; shaded until whole "
                  "again)")
    bottom.set_ylabel(f"requests per {bin_s:g} s")
    bottom.set_xlabel("seconds since the load started")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="lower left")
    fig.savefig(path, dpi=100)
    return path


def growth(values: Sequence[float | None], times: Sequence[float], start: float,
           end: float) -> dict[str, float | None]:
    """A series' value at the first sample at or after `start` and the last at or before
    `end`, and the change between them (absolute and relative)."""
    pts = [(t, v) for t, v in zip(times, values, strict=True) if v is not None]
    a = next((v for t, v in pts if t >= start), None)
    b = next((v for t, v in reversed(pts) if t <= end), None)
    if a is None or b is None:
        return {"from": a, "to": b, "change": None, "relative": None}
    return {"from": a, "to": b, "change": b - a, "relative": (b - a) / a if a else None}


def soak_growth(cols: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    t = cols["t"]
    return {
        "groups": {g: {f: growth(v, t, start, end) for f, v in figs.items()}
                   for g, figs in cols["groups"].items()},
        "redis_keys": growth(cols["redis_keys"], t, start, end),
    }


def soak_plot(cols: dict[str, Any], t0: float, load_end: float, path: Path) -> Path:
    """Every soak series over time; the end of the load marked."""
    t = np.asarray(cols["t"]) - t0
    fig = Figure(figsize=(14, 8), layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    for ax, (fig_key, title) in zip(axes[:3], (("rss_mb", "RSS (MiB)"), ("fds",
                                    "open descriptors"), ("threads", "threads")), strict=True):
        for g, figs in cols["groups"].items():
            ax.plot(t, [np.nan if v is None else v for v in figs[fig_key]], label=g)
        ax.set_title(title)
    axes[0].legend(fontsize="x-small")
    axes[3].plot(t, [np.nan if v is None else v for v in cols["redis_keys"]])
    axes[3].set_title("Redis keys (DBSIZE)")
    for w, v in cols["kv_usage"].items():
        axes[4].plot(t, [np.nan if x is None else 100 * x for x in v], label=w)
    axes[4].set_title("vLLM KV cache in use (%)")
    axes[4].legend(fontsize="x-small")
    if cols["staged"]:
        for k, v in cols["staged"].items():
            axes[5].plot(t, [np.nan if x is None else x for x in v], label=k)
        axes[5].legend(fontsize="x-small")
    else:
        axes[5].text(0.5, 0.5, "no pdserve_kv_*staged* gauge exported",
                     ha="center", va="center", transform=axes[5].transAxes)
    axes[5].set_title("staged KV transfers")
    for ax in axes:
        ax.axvline((load_end - t0), color="grey", linestyle=":")
        ax.set_xlabel("seconds since the load started")
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    return path
