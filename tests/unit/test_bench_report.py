"""Output files, comparison table and command line of the bench harness (no network)."""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import pytest

from services.bench import cli
from services.bench.compare import compare_table, load_summary, write_compare_report
from services.bench.report import read_records_jsonl, write_report
from services.bench.runner import RunResult
from services.bench.targets import check_host
from services.traffic.arrivals import ArrivalConfig
from services.traffic.flags import request_count
from services.traffic.record import RequestRecord, ServerTimings
from services.traffic.slo import SLOs, parse_slos


def fake_run(label: str, rate: float, ttft: float, n: int = 6) -> RunResult:
    records = []
    for i in range(n):
        chunks = [ttft + 0.01 * k for k in range(4)]
        records.append(RequestRecord(
            run=label, index=i, request_id=f"{label}-{i}", kind="random", prompt_tokens=16,
            max_tokens=4, scheduled_s=i / rate if math.isfinite(rate) else 0.0,
            warmup=i == 0, send_time=1000.0 + i * 0.1, chunk_offsets=chunks,
            chunk_tokens=[1] * 4, e2e_s=chunks[-1] + 0.001, output_tokens=4, ok=i != 3,
            error_code="" if i != 3 else "RESOURCE_EXHAUSTED",
            server=ServerTimings(queue_s=0.001, prefill_s=ttft / 2, ttft_s=ttft * 0.9,
                                 decode_s=0.03, e2e_s=ttft * 0.9 + 0.031)))
    return RunResult(label, ArrivalConfig(rate=rate), records, 1000.0, 1.0)


def test_write_report_produces_every_file(tmp_path: Path) -> None:
    runs = [fake_run("rate-1", 1.0, 0.1), fake_run("rate-2", 2.0, 0.2),
            fake_run("rate-inf", math.inf, 0.4)]
    doc = write_report(tmp_path, runs, SLOs(ttft_s=0.15), {"target": "test"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == doc
    assert [r["label"] for r in summary["runs"]] == ["rate-1", "rate-2", "rate-inf"]
    assert summary["runs"][2]["rate"] is None  # inf is not JSON
    assert summary["runs"][0]["good_requests"] == 4 and summary["runs"][1]["goodput"] == 0
    with (tmp_path / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and float(rows[0]["ttft_s_p50"]) == pytest.approx(0.1)
    with (tmp_path / "requests.csv").open() as f:
        req_rows = list(csv.DictReader(f))
    assert len(req_rows) == 18 and req_rows[0]["server_prefill_s"]
    back = read_records_jsonl(tmp_path / "requests.jsonl")
    assert back == [r for run in runs for r in run.records]
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["anatomy.png", "goodput_vs_rate.png", "latency_cdfs.png",
                    "latency_vs_rate.png"]
    assert all((tmp_path / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    assert "RESOURCE_EXHAUSTED" in page and "prefill_queue" in page


def test_compare_pairs_runs_by_label_and_writes_a_report(tmp_path: Path) -> None:
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    write_report(a_dir, [fake_run("rate-1", 1.0, 0.1)], SLOs(), {}, with_plots=False)
    write_report(b_dir, [fake_run("rate-1", 1.0, 0.2)], SLOs(), {}, with_plots=False)
    table = compare_table(load_summary(a_dir / "summary.json"),
                          load_summary(b_dir / "summary.json"))
    assert "### rate-1 vs rate-1" in table
    assert "| TTFT p50 (s) | 0.1 | 0.2 | x2.000 |" in table
    assert "anatomy prefill mean (s)" in table
    page = write_compare_report(a_dir / "summary.json", b_dir / "summary.json", tmp_path / "c")
    assert page.read_text().count("data:image/png;base64,") == 3  # bars, anatomy, CDFs
    with pytest.raises(ValueError):
        (tmp_path / "x.json").write_text("{}")
        load_summary(tmp_path / "x.json")


def test_slo_parsing() -> None:
    assert parse_slos(["ttft=2", "tpot=0.28,itl=0.3"]) == SLOs(2.0, 0.28, 0.3)
    for bad in (["ttft"], ["latency=1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_only_loopback_or_named_hosts_are_targets() -> None:
    for host in ("127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"):
        check_host(host)
    check_host("bench-target.internal", ["bench-target.internal"])
    for host in ("10.0.0.1", "example.com", "0.0.0.0", None):
        with pytest.raises(ValueError):
            check_host(host)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser


def test_every_option_has_help() -> None:
    parser = make_parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    subs = bench._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(subs) == {"run", "sweep", "compare"}
    for sub in subs.values():
        for action in sub._actions:
            assert action.help, f"{sub.prog} {action.dest} has no help"
            assert "default" in sub.formatter_class(sub.prog)._get_help_string(action) or \
                action.dest in ("help", "a", "b")


def test_parsed_commands_carry_their_function() -> None:
    args = make_parser().parse_args(["bench", "sweep", "--rates", "1", "inf", "--slo",
                                     "ttft=1", "--vocab-size", "100"])
    assert args.func is cli.cmd_sweep and args.rates == [1.0, math.inf]
    args = make_parser().parse_args(["bench", "compare", "a.json", "b.json"])
    assert args.func is cli.cmd_compare
    with pytest.raises(SystemExit):
        make_parser().parse_args(["bench", "run", "--rate", "0"])


def test_request_count_covers_the_duration() -> None:
    parser = make_parser()
    args = parser.parse_args(["bench", "run", "--rate", "10", "--duration", "20"])
    assert request_count(args, [10.0]) == 316
    args = parser.parse_args(["bench", "run", "--num-requests", "7", "--duration", "20"])
    assert request_count(args, [math.inf]) == 7
    args = parser.parse_args(["bench", "run", "--duration", "20"])
    with pytest.raises(ValueError):
        request_count(args, [math.inf])
    assert request_count(parser.parse_args(["bench", "run"]), [1.0]) == 200
