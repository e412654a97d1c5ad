"""Benchmark output files: JSON summary, per-request JSONL and CSV, plots, one HTML page.

Layout of an output folder::

    summary.json    {"meta": {...}, "runs": [one summary per run / rate]}
    summary.csv     one row per run: throughput, goodput, latency percentiles
    requests.jsonl  one RequestRecord per line (all runs; warm-up flagged, not dropped)
    requests.csv    the same records, flat, with derived TTFT / TPOT / largest ITL
    plots/*.png     latency CDFs, latency and goodput vs rate, anatomy bars
    report.html     everything above in one self-contained page (PNGs inlined)

A run repeated N times (``--runs N``) is one entry of ``runs``: each figure is the median
over its repetitions (``errors``: totals; ``overload``: the first overloaded repetition's,
with how many were), ``intervals`` holds the main metrics' medians with their confidence
intervals (``services.traffic.intervals``), and ``repetitions`` each repetition's own
summary. Its records keep their repetition's label (``<label>/run-<k>``).
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import html
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.bench.runner import RunResult
from services.traffic.arrivals import TRACE
from services.traffic.intervals import describe, interval
from services.traffic.latency import ANATOMY_SEGMENTS, itls, tpot
from services.traffic.overload import judge
from services.traffic.record import RequestRecord, ServerTimings
from services.traffic.slo import SLOs
from services.traffic.summary import summarize

SUMMARY_COLUMNS = [
    "label", "rate", "requests", "completed", "failed", "duration_s", "request_throughput",
    "output_token_throughput", "total_token_throughput", "goodput", "goodput_share",
]
STAT_COLUMNS = [(m, s) for m in ("ttft_s", "tpot_s", "itl_s", "e2e_s")
                for s in ("mean", "p50", "p90", "p99")]
# Metrics a repeated run reports with a confidence interval, as paths in a run summary.
INTERVAL_METRICS: list[tuple[str, ...]] = [
    ("request_throughput",), ("output_token_throughput",), ("goodput",), ("goodput_share",),
    *((m, s) for m in ("ttft_s", "tpot_s", "itl_s", "e2e_s") for s in ("p50", "p90", "p99",
                                                                         "mean")),
]
# The intervals summary.csv and the console show.
SHOWN_INTERVALS = ["request_throughput", "goodput", "ttft_s.p50", "ttft_s.p99", "tpot_s.p50",
                   "itl_s.p99"]


@dataclass(frozen=True, slots=True)
class Repeats:
    """How often each run is repeated and how its intervals are computed."""

    runs: int = 1
    level: float = 0.95
    method: str = "t"

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise ValueError(f"--runs must be >= 1, got {self.runs}")
        interval([0.0, 1.0], self.level, self.method)  # checks the level and the method


def _json_safe(value: Any) -> Any:
    """inf/nan are not JSON: rates of inf are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def run_summary(result: RunResult, slos: SLOs) -> dict[str, Any]:
    return {
        "label": result.label,
        "rate": result.arrivals.rate,
        "arrivals": dataclasses.asdict(result.arrivals),
        "started_at": result.started_at,
        "wall_s": result.wall_s,
        **summarize(result.records, slos),
        "overload": judge([r for r in result.records if not r.warmup],
                          "lower --trace-rate or --speed" if result.arrivals.process == TRACE
                          else "lower --rate").as_dict(),
    }


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _merge(values: list[Any]) -> Any:
    """The median over repetitions of every number in their summaries (dicts merged key by
    key); anything else is the first repetition's."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, dict) for v in present):
        keys = list(dict.fromkeys(k for v in present for k in v))
        return {k: _merge([v.get(k) for v in present]) for k in keys}
    if all(_is_number(v) for v in present):
        median = float(np.median(np.asarray(present, dtype=float)))
        if all(isinstance(v, int) for v in present) and median.is_integer():
            return int(median)
        return median
    return present[0]


def _path(summary: dict[str, Any], path: Sequence[str]) -> Any:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def repeated_summary(label: str, results: Sequence[RunResult], slos: SLOs,
                     repeats: Repeats) -> dict[str, Any]:
    """One summary for the repetitions of a run: medians, intervals, each repetition."""
    per = [run_summary(r, slos) for r in results]
    out: dict[str, Any] = _merge(per)
    out["label"] = label
    out["errors"] = dict(sum((Counter(s["errors"]) for s in per), Counter()).most_common())
    overloaded = [s["overload"] for s in per if (s.get("overload") or {}).get("overloaded")]
    out["overload"] = {**(overloaded[0] if overloaded else per[0]["overload"]),
                       "runs_overloaded": len(overloaded)}
    if overloaded and len(per) > 1:
        out["overload"]["warning"] = (f"in {len(overloaded)} of {len(per)} runs: "
                                      + overloaded[0].get("warning", ""))
    out["repeats"] = len(per)
    out["interval_method"] = describe(repeats.method, repeats.level)
    out["intervals"] = {}
    for path in INTERVAL_METRICS:
        values = [_path(s, path) for s in per]
        if all(_is_number(v) and math.isfinite(v) for v in values):
            out["intervals"][".".join(path)] = interval(values, repeats.level,
                                                        repeats.method).as_dict()
    coverage = min((iv["coverage"] for iv in out["intervals"].values()), default=1.0)
    if coverage < repeats.level:  # too few runs for the level: say what it covers
        out["interval_method"] += (f" (with {len(per)} runs: the runs' whole range, "
                                   f"which covers {coverage:.0%})")
    out["repetitions"] = per
    return out


def group_results(results: Sequence[RunResult]) -> list[tuple[str, list[RunResult]]]:
    """Repetitions of one run together (by ``group``), in the order they first ran."""
    groups: dict[str | int, tuple[str, list[RunResult]]] = {}
    for k, r in enumerate(results):  # a run that is no repetition stands alone
        groups.setdefault(r.group or k, (r.group or r.label, []))[1].append(r)
    return list(groups.values())


def write_records_jsonl(path: Path, records: Iterable[RequestRecord]) -> None:
    with path.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec.to_dict(), separators=(",", ":")) + "\n")


def read_records_jsonl(path: Path) -> list[RequestRecord]:
    with path.open() as f:
        return [RequestRecord.from_dict(json.loads(line)) for line in f if line.strip()]


def write_requests_csv(path: Path, records: Iterable[RequestRecord]) -> None:
    plain = ["run", "index", "request_id", "kind", "warmup", "ok", "error_code",
             "prompt_tokens", "max_tokens", "output_tokens", "cached_tokens", "finish_reason",
             "scheduled_s", "send_time", "e2e_s", "generator"]
    server = [f"server_{name}" for name in ServerTimings.field_names()]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*plain, "ttft_s", "tpot_s", "itl_max_s", "chunks", *server])
        for rec in records:
            timings = dataclasses.asdict(rec.server) if rec.server else {}
            writer.writerow([
                *(getattr(rec, name) for name in plain),
                rec.ttft_s, tpot(rec), max(itls(rec), default=None), len(rec.chunk_offsets),
                *(timings.get(name) for name in ServerTimings.field_names()),
            ])


def write_summary_csv(path: Path, summaries: Sequence[dict[str, Any]]) -> None:
    """One row per run; with repetitions, the medians and the shown metrics' intervals."""
    bounds = [f"{key.replace('.', '_')}_ci_{end}" for key in SHOWN_INTERVALS
              for end in ("low", "high")]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*SUMMARY_COLUMNS, *(f"{m}_{s}" for m, s in STAT_COLUMNS), "errors",
                         "runs", *bounds])
        for s in summaries:
            intervals = s.get("intervals") or {}
            writer.writerow([*(s[c] for c in SUMMARY_COLUMNS),
                             *(s[m][st] for m, st in STAT_COLUMNS), json.dumps(s["errors"]),
                             s.get("repeats", 1),
                             *((intervals.get(key) or {}).get(end) for key in SHOWN_INTERVALS
                               for end in ("low", "high"))])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value if value is not None else "-"))


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _anatomy_table(summaries: Sequence[dict[str, Any]]) -> str:
    runs = [s for s in summaries if s.get("anatomy")]
    if not runs:
        return "<p>No server timings in these runs (anatomy needs pdserve's final message).</p>"
    segments = list(ANATOMY_SEGMENTS)
    rows = [[s["label"], *(s["anatomy"][seg]["mean"] for seg in segments)] for s in runs]
    return "<p>Mean seconds per request.</p>" + _table(["run", *segments], rows)


def _intervals_table(summaries: Sequence[dict[str, Any]]) -> str:
    runs = [s for s in summaries if s.get("intervals")]
    if not runs:
        return ""
    rows = [[s["label"], key, iv["median"], iv["low"], iv["high"], iv["coverage"], iv["n"]]
            for s in runs for key, iv in s["intervals"].items()]
    methods = sorted({s["interval_method"] for s in runs})
    return (f"<h2>Repeated runs</h2><p>Medians over the runs with a {'; '.join(methods)} "
            "(coverage: what the interval covers, below the level when there are too few "
            "runs for it).</p>"
            + _table(["run", "metric", "median", "low", "high", "coverage", "runs"], rows))


def render_html(meta: dict[str, Any], summaries: Sequence[dict[str, Any]],
                images: Sequence[Path], title: str = "pdserve bench") -> str:
    """One self-contained page: summary tables and the PNGs inlined as base64."""
    meta_rows = [(k, json.dumps(v) if isinstance(v, dict | list) else v)
                 for k, v in meta.items()]
    stat_header = [f"{m.removesuffix('_s')} {s}" for m, s in STAT_COLUMNS]
    runs = _table([*SUMMARY_COLUMNS, "errors"],
                  [[*(s[c] for c in SUMMARY_COLUMNS), json.dumps(s["errors"])]
                   for s in summaries])
    lat = _table(["label", *stat_header],
                 [[s["label"], *(s[m][st] for m, st in STAT_COLUMNS)] for s in summaries])
    imgs = "".join(
        f'<h3>{html.escape(p.stem)}</h3><img alt="{html.escape(p.stem)}" '
        f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        for p in images)
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
             "margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
             "img{max-width:100%}")
    warnings = "".join(
        f"<p><b>{html.escape(str(s['label']))}</b>: {html.escape(w)}</p>"
        for s in summaries if (w := (s.get("overload") or {}).get("warning")))
    title = html.escape(title)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}"
            f"</title><style>{style}</style></head><body><h1>{title}</h1>"
            f"<h2>Setup</h2>{_table(['key', 'value'], meta_rows)}"
            f"<h2>Runs</h2>{warnings}{runs}<h2>Latency (seconds)</h2>{lat}"
            f"{_intervals_table(summaries)}"
            f"<h2>Anatomy</h2>{_anatomy_table(summaries)}<h2>Plots</h2>{imgs}"
            f"</body></html>")


def text_summary(summary: dict[str, Any]) -> str:
    """Two lines per run for the terminal, and a third when the run was overloaded."""
    s = summary

    def lat(metric: str) -> str:
        st = s[metric]
        return f"{metric.removesuffix('_s').upper()} p50 {_num(st['p50'])} p99 {_num(st['p99'])}"

    errors = f" errors {s['errors']}" if s["errors"] else ""
    warning = (s.get("overload") or {}).get("warning", "")
    intervals = s.get("intervals") or {}
    shown = [f"{key.replace('_s.', ' ').replace('_', ' ')} {_num(iv['median'])} "
             f"[{_num(iv['low'])}, {_num(iv['high'])}]"
             for key in SHOWN_INTERVALS if (iv := intervals.get(key))]
    repeated = (f"\n  medians of {s['repeats']} runs, {s['interval_method']}:\n    "
                + " | ".join(shown)) if shown else ""
    return (f"{s['label']}: {s['completed']} ok / {s['failed']} failed in "
            f"{s['duration_s']:.1f} s | {s['request_throughput']:.3g} req/s, "
            f"{s['output_token_throughput']:.4g} out tok/s | goodput {s['goodput']:.3g} req/s "
            f"({100 * s['goodput_share']:.0f}%){errors}\n  "
            + " | ".join(lat(m) for m in ("ttft_s", "tpot_s", "itl_s", "e2e_s")) + " (s)"
            + repeated + (f"\n  {warning}" if warning else ""))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def draw_plots(out_dir: Path, runs: Sequence[tuple[str, Sequence[RequestRecord]]],
               summaries: Sequence[dict[str, Any]]) -> list[Path]:
    from services.bench import plots  # matplotlib: only when plots are drawn

    plot_dir = out_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    drawn = [
        plots.latency_cdfs(runs, plot_dir / "latency_cdfs.png"),
        plots.latency_vs_rate(summaries, plot_dir / "latency_vs_rate.png"),
        plots.goodput_vs_rate(summaries, plot_dir / "goodput_vs_rate.png"),
        plots.anatomy_bars([(s["label"], s) for s in summaries], plot_dir / "anatomy.png"),
    ]
    return [p for p in drawn if p is not None]


def write_report(out_dir: Path, results: Sequence[RunResult], slos: SLOs,
                 meta: dict[str, Any], with_plots: bool = True,
                 repeats: Repeats | None = None) -> dict[str, Any]:
    """Writes every output file for ``results``; returns the summary document.
    Repetitions of one run (``RunResult.group``) are summarised together."""
    out_dir.mkdir(parents=True, exist_ok=True)
    repeats = repeats or Repeats()
    groups = group_results(results)
    summaries = [repeated_summary(label, rs, slos, repeats) if rs[0].group
                 else run_summary(rs[0], slos) for label, rs in groups]
    document = _json_safe({"meta": meta, "runs": summaries})
    (out_dir / "summary.json").write_text(json.dumps(document, indent=2) + "\n")
    write_summary_csv(out_dir / "summary.csv", summaries)
    records = [rec for r in results for rec in r.records]
    write_records_jsonl(out_dir / "requests.jsonl", records)
    write_requests_csv(out_dir / "requests.csv", records)
    images: list[Path] = []
    if with_plots:
        images = draw_plots(out_dir, [(label, [rec for r in rs for rec in r.records])
                                      for label, rs in groups], summaries)
    (out_dir / "report.html").write_text(render_html(meta, summaries, images))
    return dict(document)
