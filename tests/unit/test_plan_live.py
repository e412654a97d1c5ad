"""The live planner's logic: vLLM's histograms read off a Prometheus page (written by
prometheus_client itself), windows of traffic, lengths drawn like the observed ones,
and the decision rules (floors, margin, cool-down, too little traffic) on the published
GPU profile. The launcher's loop around it is in tests/integration/test_planner_live.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as PromHistogram

from services.cli import main
from services.plan.costmodel import Profile
from services.plan.live import (
    OUTPUT,
    PROMPT,
    Histogram,
    LivePlanner,
    PlannerError,
    PlannerSettings,
    Traffic,
    TrafficMeter,
    draw_lengths,
    read_histograms,
)
from services.traffic.slo import SLOs

ROOT = Path(__file__).resolve().parents[2]
GPU_PROFILE = ROOT / "services/plan/profiles/llama-3.1-8b-h100.json"
BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)  # vLLM's
SLO = SLOs(ttft_s=2.0, itl_s=0.1)


class VllmPage:
    """A Prometheus registry with vLLM's two request-length histograms, two engines."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.prompt = PromHistogram(PROMPT, "", ["engine"], buckets=BUCKETS,
                                    registry=self.registry)
        self.output = PromHistogram(OUTPUT, "", ["engine"], buckets=BUCKETS,
                                    registry=self.registry)

    def finish(self, prompt: int, output: int, engine: str = "0") -> None:
        self.prompt.labels(engine).observe(prompt)
        self.output.labels(engine).observe(output)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def hist(values: list[float]) -> Histogram:
    v = np.asarray(values)
    return Histogram(len(v), float(v.sum()),
                     tuple((float(le), float((v <= le).sum())) for le in (*BUCKETS, np.inf)))


def test_histograms_are_summed_over_engines() -> None:
    page = VllmPage()
    page.finish(300, 40, "0")
    page.finish(1500, 8, "1")
    got = read_histograms(page.text())
    assert got[PROMPT].count == 2 and got[PROMPT].total == 1800
    assert got[OUTPUT].total == 48 and got[OUTPUT].mean == 24
    assert dict(got[PROMPT].buckets)[500.0] == 1 and dict(got[PROMPT].buckets)[2000.0] == 2
    assert read_histograms("# nothing here\n") == {}


def test_a_window_is_the_difference_of_two_scrapes_and_skips_restarts() -> None:
    a, b = VllmPage(), VllmPage()
    a.finish(100, 10)
    meter = TrafficMeter()
    assert meter.window({"d0": (1, a.text()), "d1": (1, b.text())}, now=0.0) is None
    a.finish(200, 20)
    a.finish(300, 30)
    b.finish(1000, 5)
    t = meter.window({"d0": (1, a.text()), "d1": (1, b.text())}, now=10.0)
    assert t is not None and t.seconds == 10.0 and t.requests == 3 and t.rate == 0.3
    assert t.prompt.total == 1500 and t.output.total == 55
    # d1 restarted (a new epoch: its counters began again) and d0's page is unreadable:
    # neither counts in this window; d1 counts from its next scrape.
    fresh = VllmPage()
    fresh.finish(50, 5)
    t = meter.window({"d0": (1, None), "d1": (2, fresh.text())}, now=20.0)
    assert t is not None and t.requests == 0
    fresh.finish(60, 6)
    t = meter.window({"d1": (2, fresh.text())}, now=30.0)
    assert t is not None and t.requests == 1 and t.prompt.total == 60


def test_a_counter_that_went_back_gives_no_difference() -> None:
    assert hist([5, 6]).minus(hist([5, 6, 7])) is None
    d = hist([5, 60, 600]).minus(hist([5]))
    assert d is not None and d.count == 2 and d.total == 660


def test_drawn_lengths_have_the_observed_mean_and_shape() -> None:
    observed = [100] * 90 + [3000] * 10  # chat plus a tenth of long prompts
    h = hist(observed)
    v = draw_lengths(h, 20_000, np.random.default_rng(0))
    assert v.min() >= 1 and abs(v.mean() - h.mean) / h.mean < 0.01
    assert 0.05 < (v > 1000).mean() < 0.15  # the long tenth stays a tenth
    assert draw_lengths(Histogram(4, 40), 3, np.random.default_rng(0)).tolist() == [10] * 3


def planner(**changes: object) -> LivePlanner:
    settings = dataclasses.replace(PlannerSettings(SLO), **changes)  # type: ignore[arg-type]
    return LivePlanner(Profile.load(GPU_PROFILE), settings, transport="torch")


def traffic(prompt: int, output: int, rate: float, seconds: float = 60.0) -> Traffic:
    n = round(rate * seconds)
    rng = np.random.default_rng(1)
    return Traffic(seconds, hist(list(np.maximum(1, rng.normal(prompt, prompt / 5, n)))),
                   hist(list(np.maximum(1, rng.normal(output, output / 5, n)))))


def test_long_prompts_move_workers_to_prefill_then_it_cools_down() -> None:
    p = planner(cooldown_s=300.0)
    long = traffic(6000, 150, rate=12)
    d = p.decide(long, (1, 7), now=1000.0)
    assert d.action == "resize" and d.chosen[0] >= 3 and sum(d.chosen) == 8, d
    assert d.goodput[d.chosen] > d.goodput[(1, 7)] * 1.2
    again = p.decide(long, (1, 7), now=1100.0)
    assert again.action == "wait" and again.chosen == (1, 7)
    assert p.decide(long, d.chosen, now=1400.0).action == "keep"  # after the cool-down


def test_gains_within_the_margin_do_not_move_workers() -> None:
    d = planner().decide(traffic(300, 400, rate=20), (4, 4), now=0.0)
    assert d.action == "keep" and d.chosen == (4, 4), d
    assert max(d.goodput.values()) <= d.goodput[(4, 4)] * 1.2


def test_too_little_traffic_decides_nothing() -> None:
    d = planner(min_requests=30).decide(traffic(6000, 150, rate=0.4), (1, 7), now=0.0)
    assert d.action == "idle" and "24 requests" in d.reason and not d.goodput
    assert planner().decide(None, (1, 7), now=0.0).action == "idle"


def test_candidates_keep_the_floors_and_the_total() -> None:
    p = planner(min_prefill=2, min_decode=3, max_candidates=4)
    splits = p.candidates((5, 11))
    assert all(pf >= 2 and d >= 3 and pf + d == 16 for pf, d in splits)
    assert (5, 11) in splits and (4, 12) in splits and (6, 10) in splits
    assert (2, 14) in splits and (13, 3) in splits
    assert planner(min_prefill=0).candidates((1, 1)) == [(0, 2), (1, 1)]
    assert planner(min_prefill=1, min_decode=1).candidates((0, 1)) == [(0, 1)]  # too small


def test_a_core_profile_and_bad_floors_are_refused() -> None:
    cpu = dataclasses.replace(Profile.load(GPU_PROFILE), unit="core")
    with pytest.raises(PlannerError, match="pdserve plan predict"):
        LivePlanner(cpu, PlannerSettings(SLO))
    with pytest.raises(PlannerError, match="floors"):
        planner(min_decode=0)


@pytest.mark.parametrize(("args", "message"), [
    (["--planner-profile", "missing.json"], "--planner-profile missing.json"),
    (["--planner-profile", str(GPU_PROFILE), "--planner-slo", "ttft"], "bad SLO 'ttft'"),
    (["--planner-profile", str(GPU_PROFILE)], "--prefill-accelerator"),
])
def test_pdserve_up_refuses_a_planner_that_cannot_work(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["up", *args]) == 1  # before Redis or Ray is started
    assert message in capsys.readouterr().err
