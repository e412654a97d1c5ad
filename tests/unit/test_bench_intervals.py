"""Repeated runs: the interval math (t quantiles against published tables, order-statistic
coverage), the summary of repetitions in summary.json/csv/report, and `bench compare`'s
reading of intervals."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from services.bench.compare import compare_table, differences, interval_verdict
from services.bench.report import Repeats, text_summary, write_report
from services.bench.runner import RunResult
from services.traffic.arrivals import ArrivalConfig
from services.traffic.intervals import (
    Interval,
    binomial_cdf,
    interval,
    median_order_interval,
    t_quantile,
)
from services.traffic.record import RequestRecord
from services.traffic.slo import SLOs


@pytest.mark.parametrize("df, expected", [
    (1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423), (1000, 1.9623)])
def test_t_quantiles_match_the_tables(df: int, expected: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-4)


def test_t_interval_on_the_mean() -> None:
    iv = interval([1.0, 2.0, 3.0, 4.0, 10.0], 0.95, "t")
    s = float(np.std([1, 2, 3, 4, 10], ddof=1))
    half = 2.7764451 * s / math.sqrt(5)
    assert (iv.median, iv.mean) == (3.0, 4.0)
    assert (iv.low, iv.high) == pytest.approx((4.0 - half, 4.0 + half))
    assert iv.coverage == 0.95 and iv.n == 5 and iv.method == "t"
    wider = interval([1.0, 2.0, 3.0, 4.0, 10.0], 0.99, "t")
    assert wider.low < iv.low and wider.high > iv.high


def test_order_statistic_interval_of_the_median() -> None:
    assert binomial_cdf(1, 10) == pytest.approx(11 / 1024)
    # 10 runs: the 2nd smallest to the 2nd largest covers 1 - 2 * 11/1024 >= 95%
    low, high, coverage = median_order_interval(list(range(10)), 0.95)
    assert (low, high) == (1.0, 8.0) and coverage == pytest.approx(1 - 22 / 1024)
    # 3 runs cannot reach 95%: the whole range, and its true coverage 75%
    iv = interval([3.0, 1.0, 2.0], 0.95, "order")
    assert (iv.low, iv.median, iv.high, iv.coverage) == (1.0, 2.0, 3.0, 0.75)


def test_one_run_has_no_spread() -> None:
    iv = interval([2.5], 0.95)
    assert (iv.low, iv.high, iv.std, iv.coverage) == (2.5, 2.5, 0.0, 0.0)


@pytest.mark.parametrize("level, method", [(1.0, "t"), (0.0, "t"), (0.9, "bootstrap")])
def test_bad_levels_and_methods_are_refused(level: float, method: str) -> None:
    with pytest.raises(ValueError):
        interval([1.0, 2.0], level, method)


def test_overlap_verdicts() -> None:
    def iv(low: float, high: float) -> Interval:
        return Interval((low + high) / 2, low, high, (low + high) / 2, 0.1, 3, 0.95, 0.95, "t")

    assert interval_verdict(iv(1, 2), iv(1.5, 3)) == "overlap"
    assert interval_verdict(iv(1, 2), iv(2.5, 3)) == "apart: B higher"
    assert interval_verdict(iv(1, 2), iv(0.1, 0.5)) == "apart: B lower"
    assert interval_verdict(None, iv(1, 2)) == "-"


def repetition(label: str, k: int, ttft: float, n: int = 5) -> RunResult:
    records = [RequestRecord(
        run=f"{label}/run-{k}", index=i, request_id=f"{k}-{i}", kind="random",
        prompt_tokens=8, max_tokens=3, scheduled_s=i * 0.5, send_time=1000.0 + i * 0.5,
        chunk_offsets=[ttft, ttft + 0.02, ttft + 0.04], chunk_tokens=[1, 1, 1],
        e2e_s=ttft + 0.05, output_tokens=3, ok=True) for i in range(n)]
    return RunResult(f"{label}/run-{k}", ArrivalConfig(rate=2.0), records, 1000.0, 3.0,
                     group=label)


def test_repeated_runs_are_one_summary_with_intervals(tmp_path: Path) -> None:
    reps = [repetition("rate-2", k + 1, ttft) for k, ttft in enumerate((0.10, 0.30, 0.20))]
    doc = write_report(tmp_path, reps, SLOs(ttft_s=0.25), {"target": "t"}, with_plots=False,
                       repeats=Repeats(3, 0.95, "t"))
    (run,) = doc["runs"]
    assert run["label"] == "rate-2" and run["repeats"] == 3
    assert run["ttft_s"]["p50"] == pytest.approx(0.20)  # the median of the three runs
    assert [r["ttft_s"]["p50"] for r in run["repetitions"]] == pytest.approx([0.1, 0.3, 0.2])
    ttft = run["intervals"]["ttft_s.p50"]
    assert ttft["median"] == pytest.approx(0.2) and ttft["n"] == 3
    half = 4.3026527 * 0.1 / math.sqrt(3)
    assert (ttft["low"], ttft["high"]) == pytest.approx((0.2 - half, 0.2 + half))
    # goodput: 5, 0 and 5 requests within 0.25 s in the three runs
    assert run["intervals"]["goodput_share"]["median"] == 1.0
    assert run["completed"] == 5
    assert "Student's t" in run["interval_method"]
    with (tmp_path / "summary.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["runs"] == "3" and float(row["ttft_s_p50_ci_low"]) == pytest.approx(0.2 - half)
    assert "<h2>Repeated runs</h2>" in (tmp_path / "report.html").read_text()
    lines = text_summary(run).splitlines()
    assert "medians of 3 runs, 95% Student's t interval" in lines[2]
    assert "ttft p50 0.2 [" in lines[3]
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").open()]
    assert {r["run"] for r in records} == {"rate-2/run-1", "rate-2/run-2", "rate-2/run-3"}


def test_compare_reads_the_intervals(tmp_path: Path) -> None:
    slow = [repetition("rate-2", k + 1, t) for k, t in enumerate((0.50, 0.52, 0.51))]
    fast = [repetition("rate-2", k + 1, t) for k, t in enumerate((0.20, 0.21, 0.22))]
    noisy = [repetition("rate-2", k + 1, t) for k, t in enumerate((0.20, 0.60, 0.45))]
    a = write_report(tmp_path / "a", slow, SLOs(), {}, False, Repeats(3))
    b = write_report(tmp_path / "b", fast, SLOs(), {}, False, Repeats(3))
    c = write_report(tmp_path / "c", noisy, SLOs(), {}, False, Repeats(3))
    table = compare_table(a, b)
    row = next(line for line in table.splitlines() if line.startswith("| TTFT p50"))
    assert row.endswith("| apart: B lower |")
    assert "0.51 [" in row and "0.21 [" in row
    row = next(line for line in compare_table(a, c).splitlines()
               if line.startswith("| TTFT p50"))
    assert row.endswith("| overlap |")
    assert "medians of 3 runs" in table


def test_runs_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="--runs must be >= 1"):
        Repeats(0)


def test_compare_names_what_differs_between_two_replays() -> None:
    def doc(speed: float, factor: float) -> dict[str, object]:
        trace = {"file": "conversation_trace.jsonl", "speed": speed, "rate": None,
                 "window": {"start_s": 0.0, "requests": 24},
                 "lengths": {"factor": factor, "max_model_len": 2048}}
        return {"meta": {"trace": trace}, "runs": []}

    lines = differences(doc(1.0, 0.25), doc(2.0, 0.25))
    assert lines == ["trace speed: A 1, B 2"]
    assert differences(doc(1.0, 0.25), doc(1.0, 0.25)) == []


def test_too_few_runs_for_the_level_say_what_they_cover(tmp_path: Path) -> None:
    reps = [repetition("rate-2", k + 1, ttft) for k, ttft in enumerate((0.1, 0.3, 0.2))]
    doc = write_report(tmp_path, reps, SLOs(), {}, False, Repeats(3, 0.95, "order"))
    (run,) = doc["runs"]
    assert run["intervals"]["ttft_s.p50"]["low"] == pytest.approx(0.1)
    assert run["intervals"]["ttft_s.p50"]["high"] == pytest.approx(0.3)
    assert "whole range, which covers 75%" in run["interval_method"]
