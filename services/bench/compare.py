"""``pdserve bench compare A.json B.json``: two benchmark summaries side by side.

Runs are paired by label (a sweep's ``rate-2`` with the other sweep's ``rate-2``), or by
position when the labels differ (one run each: A's run against B's run). The table is
Markdown, which reads as well in a terminal as in an issue or a PR. Runs of different
workloads or SLOs are still compared, under a warning that lists what differs: their ratios
measure the workloads as much as the servers.

Runs repeated with ``--runs N`` carry confidence intervals: their cells show the median
and the interval, and a last column says whether A's and B's intervals overlap (the
difference is then within the runs' own spread) or lie apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.bench.report import read_records_jsonl, render_html
from services.traffic.intervals import Interval
from services.traffic.latency import ANATOMY_SEGMENTS
from services.traffic.record import RequestRecord

# (key path, label, higher is better)
ROWS: list[tuple[tuple[str, ...], str, bool]] = [
    (("request_throughput",), "requests/s", True),
    (("output_token_throughput",), "output tokens/s", True),
    (("goodput",), "goodput (req/s, all SLOs)", True),
    (("failed",), "failed requests", False),
    *(((m, s), f"{name} {s} (s)", False)
      for m, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))
      for s in ("p50", "p90", "p99", "mean")),
]


def load_summary(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    if "runs" not in document:
        raise ValueError(f"{path} is not a pdserve bench summary.json")
    return document


def pair_runs(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[dict[str, Any],
                                                                   dict[str, Any]]]:
    by_label = {run["label"]: run for run in b["runs"]}
    pairs = [(run, by_label[run["label"]]) for run in a["runs"] if run["label"] in by_label]
    return pairs or list(zip(a["runs"], b["runs"], strict=False))


# Workload fields named for people; the rest go by their own names.
_WORKLOAD_NAMES = {
    "dataset": "dataset", "input_len": "input length (tokens)",
    "output_len": "output length (tokens)", "num_requests": "requests",
    "prompt_as": "prompts sent as", "path": "dataset file", "seed": "seed",
}
# Arrival fields that change the load a server sees.
_ARRIVAL_NAMES = {
    "rate": "request rate (req/s)", "process": "arrival process", "burstiness": "burstiness",
    "ramp_from": "ramp start rate", "ramp_s": "ramp length (s)",
    "max_concurrency": "concurrency cap", "duration_s": "duration (s)",
}


# What a trace replay did to its trace (meta.trace), by path.
_TRACE_NAMES = {
    ("file",): "trace file", ("window", "start_s"): "trace window start (s)",
    ("window", "duration_s"): "trace window length (s)",
    ("window", "requests"): "trace requests replayed",
    ("window", "conversations"): "trace conversations", ("speed",): "trace speed",
    ("rate",): "trace replay rate (req/s)", ("lengths", "factor"): "trace length factor",
    ("lengths", "max_model_len"): "trace lengths fitted to (tokens)",
}


def _path(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = doc
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _show(value: Any) -> str:
    if isinstance(value, dict) and "mean" in value:  # a length distribution
        spread = value.get("spread") or 0
        return f"{value['mean']}" + (f" ({value.get('dist')} {spread:g})" if spread else "")
    if isinstance(value, dict):
        return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in value.items()) or "none"
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _workload(doc: dict[str, Any]) -> dict[str, Any]:
    meta = doc.get("meta") or {}
    fields = dict(meta.get("workload") or {})
    fields.pop("with_text", None)  # what prompt_as says
    fields.pop("num_requests", None)  # capped for long runs; the meta's count is the run's
    for key in ("num_requests", "prompt_as"):
        if key in meta:
            fields[key] = meta[key]
    return fields


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between the workloads, arrivals and SLOs of two summaries, one line
    each: ``name: A x, B y``."""
    lines = []
    wa, wb = _workload(a), _workload(b)
    order = list(_WORKLOAD_NAMES)
    for key in sorted(set(wa) & set(wb), key=lambda k: (order.index(k) if k in order
                                                        else len(order), k)):
        if wa[key] != wb[key]:
            lines.append(f"{_WORKLOAD_NAMES.get(key, key)}: A {_show(wa[key])}, "
                         f"B {_show(wb[key])}")
    ta, tb = (doc.get("meta", {}).get("trace") or {} for doc in (a, b))
    for trace_key, name in _TRACE_NAMES.items():
        va, vb = _path(ta, trace_key), _path(tb, trace_key)
        if (ta or tb) and va != vb:
            lines.append(f"{name}: A {_show(va)}, B {_show(vb)}")
    for run_a, run_b in pair_runs(a, b):
        where = (f" ({run_a['label']} vs {run_b['label']})"
                 if len(a["runs"]) > 1 or len(b["runs"]) > 1 else "")
        arr_a, arr_b = run_a.get("arrivals") or {}, run_b.get("arrivals") or {}
        for key, name in _ARRIVAL_NAMES.items():
            if key in arr_a and key in arr_b and arr_a[key] != arr_b[key]:
                lines.append(f"{name}{where}: A {_show(arr_a[key])}, B {_show(arr_b[key])}")
        if run_a.get("slos") != run_b.get("slos"):
            lines.append(f"goodput SLOs (s){where}: A {_show(run_a.get('slos') or {})}, "
                         f"B {_show(run_b.get('slos') or {})}")
    return lines


def warning(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The warning printed above a comparison of unlike runs; "" for like runs."""
    lines = differences(a, b)
    if not lines:
        return ""
    return ("warning: A and B differ in workload or SLOs, so each ratio below measures the "
            "difference in workload as well as in server:\n"
            + "\n".join(f"- {line}" for line in lines))


def _get(run: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = run
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return None if value is None else float(value)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _ratio(a: float | None, b: float | None, higher_better: bool) -> str:
    if a is None or b is None or a == 0:
        return "-"
    ratio = b / a
    better = (ratio > 1) == higher_better and ratio != 1
    return f"x{ratio:.3f}" + (" (B better)" if better else "")


def _interval(run: dict[str, Any], path: tuple[str, ...]) -> Interval | None:
    data = (run.get("intervals") or {}).get(".".join(path))
    return Interval.from_dict(data) if data else None


def _with_interval(value: float | None, iv: Interval | None) -> str:
    if iv is None:
        return _cell(value)
    return f"{_cell(iv.median)} [{_cell(iv.low)}, {_cell(iv.high)}]"


def interval_verdict(ia: Interval | None, ib: Interval | None) -> str:
    """Whether two runs' intervals of one metric overlap; "-" unless both have one."""
    if ia is None or ib is None:
        return "-"
    if ia.overlaps(ib):
        return "overlap"
    return "apart: B higher" if ib.low > ia.high else "apart: B lower"


def compare_table(a: dict[str, Any], b: dict[str, Any], a_name: str = "A",
                  b_name: str = "B") -> str:
    """Markdown tables, one per paired run, under a warning when the runs differ in
    workload or SLOs."""
    blocks = [text for text in (warning(a, b),) if text]
    names = [f"{name}: {label}" for name, doc in ((a_name, a), (b_name, b))
             if (label := (doc.get("meta") or {}).get("label"))]
    if names:
        blocks.append("\n".join(names))
    for run_a, run_b in pair_runs(a, b):
        repeated = bool(run_a.get("intervals") or run_b.get("intervals"))
        lines = [f"### {run_a['label']} vs {run_b['label']}", ""]
        if repeated:
            lines += [f"{name}: medians of {run.get('repeats', 1)} runs"
                      + (f", {run['interval_method']}" if run.get("interval_method") else "")
                      for name, run in ((a_name, run_a), (b_name, run_b))]
            lines += ["", f"| metric | {a_name} | {b_name} | B/A | intervals |",
                      "| --- | ---: | ---: | ---: | --- |"]
        else:
            lines += [f"| metric | {a_name} | {b_name} | B/A |", "| --- | ---: | ---: | ---: |"]
        for path, label, higher_better in ROWS:
            va, vb = _get(run_a, path), _get(run_b, path)
            ia, ib = _interval(run_a, path), _interval(run_b, path)
            line = (f"| {label} | {_with_interval(va, ia)} | {_with_interval(vb, ib)} | "
                    f"{_ratio(va, vb, higher_better)} |")
            lines.append(line + (f" {interval_verdict(ia, ib)} |" if repeated else ""))
        if run_a.get("anatomy") and run_b.get("anatomy"):
            for seg in ANATOMY_SEGMENTS:
                va, vb = _get(run_a, ("anatomy", seg, "mean")), _get(run_b, ("anatomy", seg,
                                                                              "mean"))
                lines.append(f"| anatomy {seg} mean (s) | {_cell(va)} | {_cell(vb)} | "
                             f"{_ratio(va, vb, False)} |" + (" - |" if repeated else ""))
        blocks.append("\n".join(lines))
    if not pair_runs(a, b):
        blocks.append("(no runs to compare)")
    return "\n\n".join(blocks)


def compare_plots(a_path: Path, b_path: Path, a: dict[str, Any], b: dict[str, Any],
                  out_dir: Path) -> list[Path]:
    """Side-by-side bars per paired run, anatomy bars, and CDF overlays when each summary
    has its requests.jsonl beside it."""
    from services.bench import plots  # matplotlib: only when plots are drawn

    out_dir.mkdir(parents=True, exist_ok=True)
    drawn: list[Path] = []
    for k, (run_a, run_b) in enumerate(pair_runs(a, b)):
        name = f"{k}-{run_a['label']}"
        drawn.append(plots.side_by_side((f"A {run_a['label']}", run_a),
                                        (f"B {run_b['label']}", run_b),
                                        out_dir / f"side_by_side_{name}.png"))
        anatomy = plots.anatomy_bars([(f"A {run_a['label']}", run_a),
                                      (f"B {run_b['label']}", run_b)],
                                     out_dir / f"anatomy_{name}.png")
        if anatomy is not None:
            drawn.append(anatomy)
    jsonl_a, jsonl_b = a_path.parent / "requests.jsonl", b_path.parent / "requests.jsonl"
    if jsonl_a.exists() and jsonl_b.exists():
        grouped: dict[str, list[RequestRecord]] = {}
        for prefix, path in (("A", jsonl_a), ("B", jsonl_b)):
            for rec in read_records_jsonl(path):
                grouped.setdefault(f"{prefix} {rec.run}", []).append(rec)
        drawn.append(plots.latency_cdfs(list(grouped.items()), out_dir / "latency_cdfs.png"))
    return drawn


def write_compare_report(a_path: Path, b_path: Path, out_dir: Path) -> Path:
    """Plots and one HTML page comparing two summaries; returns the page's path."""
    a, b = load_summary(a_path), load_summary(b_path)
    images = compare_plots(a_path, b_path, a, b, out_dir / "plots")
    runs = [{**run, "label": f"{prefix} {run['label']}"}
            for prefix, doc in (("A", a), ("B", b)) for run in doc["runs"]]
    meta = {"A": str(a_path), "B": str(b_path), "A meta": a.get("meta", {}),
            "B meta": b.get("meta", {}), "differences": differences(a, b) or "none"}
    page = out_dir / "compare.html"
    page.write_text(render_html(meta, runs, images, title="pdserve bench compare"))
    return page
