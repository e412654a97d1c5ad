"""Overload detection over request records (pure logic: records are built by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.bench.report import text_summary, write_report
from services.bench.runner import RunResult
from services.traffic.arrivals import ArrivalConfig
from services.traffic.overload import MAX_QUEUE_SHARE, MIN_SERVED_SHARE, judge
from services.traffic.record import RequestRecord, ServerTimings
from services.traffic.slo import SLOs

START = 1000.0  # epoch seconds of the run's start


def served(
    n: int, rate: float, service_s: float, servers: int = 1, queue_share: float | None = None
) -> list[RequestRecord]:
    """Records of n requests due every 1/rate s, served first come first served by
    `servers` servers taking `service_s` each: the queue a real server builds."""
    free = [START] * servers
    records = []
    for i in range(n):
        due = i / rate
        k = free.index(min(free))
        begin = max(free[k], START + due)
        free[k] = begin + service_s
        e2e = free[k] - (START + due)
        timings = None
        if queue_share is not None:
            ttft = e2e / 2
            timings = ServerTimings(
                queue_s=ttft * queue_share,
                prefill_s=ttft * (1 - queue_share),
                ttft_s=ttft,
                decode_s=e2e / 2,
                e2e_s=e2e,
            )
        records.append(
            RequestRecord(
                run="r",
                index=i,
                request_id=f"r-{i}",
                kind="random",
                prompt_tokens=8,
                max_tokens=4,
                scheduled_s=due,
                send_time=START + due,
                chunk_offsets=[e2e / 2, e2e],
                chunk_tokens=[1, 3],
                e2e_s=e2e,
                output_tokens=4,
                ok=True,
                server=timings,
            )
        )
    return records


def test_a_server_that_keeps_up_is_not_overloaded() -> None:
    verdict = judge(served(40, rate=1.0, service_s=0.5))
    assert not verdict.overloaded and verdict.warning == ""
    assert verdict.served_share == pytest.approx(1.0)
    assert verdict.offered_rate == pytest.approx(1.0)


def test_arrivals_faster_than_completions_are_overload() -> None:
    # Two requests per second offered, one per second served.
    verdict = judge(served(40, rate=2.0, service_s=1.0))
    assert verdict.overloaded
    assert verdict.served_share == pytest.approx(0.5, rel=0.05)
    assert verdict.served_share < MIN_SERVED_SHARE
    assert verdict.latency_growth_s == pytest.approx(19.5, rel=0.05)
    assert verdict.warning.startswith("warning: the offered load exceeded")
    assert "about 1 req/s of the 2 req/s offered" in verdict.warning
    assert "\n" not in verdict.warning


def test_a_client_held_back_by_a_cap_counts_as_falling_behind() -> None:
    """A concurrency cap delays the sends, not the server's answers: the response time
    counted from when each request was due still grows."""
    records = served(30, rate=4.0, service_s=1.0)
    for r in records:  # the same completions, but sent only when the previous one ended
        end = r.send_time + (r.e2e_s or 0.0)
        r.send_time = end - 1.0
        r.e2e_s = 1.0
    assert judge(records).overloaded


def test_a_burst_served_in_parallel_is_not_overload() -> None:
    # Ten requests in half a second, each served at once by its own server.
    verdict = judge(served(10, rate=20.0, service_s=2.0, servers=10))
    assert not verdict.overloaded


def test_a_short_transient_is_not_a_backlog() -> None:
    """Response times that grow by less than one request's own time: no verdict."""
    records = served(20, rate=1.0, service_s=2.0)
    for k, r in enumerate(records):  # 2 s service, growing 0.5 s over the run
        r.e2e_s = 2.0 + 0.5 * k / 19
    verdict = judge(records)
    assert not verdict.overloaded


def test_queueing_that_dominates_ttft_is_reported() -> None:
    verdict = judge(served(20, rate=1.0, service_s=0.5, queue_share=0.8))
    assert verdict.queue_share_of_ttft == pytest.approx(0.8)
    assert verdict.overloaded and "queueing was 80% of the server's TTFT" in verdict.warning
    light = judge(served(20, rate=1.0, service_s=0.5, queue_share=0.1))
    assert light.queue_share_of_ttft is not None and light.queue_share_of_ttft < MAX_QUEUE_SHARE
    assert not light.overloaded


def test_too_few_or_simultaneous_requests_are_not_judged() -> None:
    few = judge(served(4, rate=2.0, service_s=1.0))
    assert few.served_share is None and not few.overloaded
    at_once = served(20, rate=2.0, service_s=1.0)
    for r in at_once:
        r.scheduled_s = 0.0  # an infinite rate: nothing to fall behind
    verdict = judge(at_once)
    assert verdict.offered_rate is None and not verdict.overloaded


def test_requests_cancelled_while_waiting_count_failed_ones_do_not() -> None:
    records = served(40, rate=2.0, service_s=1.0)
    for r in records[30:]:  # cancelled at the run's end: still waiting
        r.ok, r.error_code = False, "CANCELLED_BY_CLIENT"
    assert judge(records).overloaded
    refused = served(40, rate=1.0, service_s=0.5)
    for r in refused[::2]:
        r.ok, r.error_code, r.e2e_s = False, "RESOURCE_EXHAUSTED", 0.001
    assert not judge(refused).overloaded


def test_the_verdict_is_in_summary_json_and_one_console_line(tmp_path: Path) -> None:
    heavy = RunResult("rate-2", ArrivalConfig(rate=2.0), served(40, 2.0, 1.0), START, 40.0)
    light = RunResult("rate-1", ArrivalConfig(rate=1.0), served(40, 1.0, 0.5), START, 40.0)
    write_report(tmp_path, [heavy, light], SLOs(), {}, with_plots=False)
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert runs[0]["overload"]["overloaded"] and not runs[1]["overload"]["overloaded"]
    heavy_text, light_text = (text_summary(run) for run in runs)
    assert heavy_text.splitlines()[-1].strip().startswith("warning: the offered load")
    assert "warning" not in light_text and len(light_text.splitlines()) == 2
    page = (tmp_path / "report.html").read_text()
    assert page.count("warning: the offered load exceeded") == 1
