"""Predictions: one seeded schedule (the one `pdserve bench` would send), simulated on
every configuration at every rate, summarised with the benchmark's own metric code, and
ranked by goodput under the SLOs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from services.plan.costmodel import Profile
from services.plan.fleet import Fleet, FleetConfig, SimRequest, SimResult
from services.traffic.arrivals import ArrivalConfig, send_offsets
from services.traffic.record import RequestRecord
from services.traffic.slo import SLOs
from services.traffic.summary import summarize
from services.traffic.workload import Tokenizer, WorkloadConfig, build_workload

SUMMARY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def schedule(workload: WorkloadConfig, arrivals: ArrivalConfig, num_requests: int,
             tokenizer: Tokenizer | None = None) -> tuple[list[SimRequest], list[bool]]:
    """The requests and send times `pdserve bench` would use, with their warm-up flags.
    Only lengths matter to the simulation: random prompts draw from a stand-in
    vocabulary when the workload names none (the lengths do not depend on it)."""
    if tokenizer is None and workload.vocab_size is None:
        workload = replace(workload, vocab_size=1000)
    specs = build_workload(replace(workload, num_requests=min(num_requests, 10_000)),
                           tokenizer)
    offsets = send_offsets(arrivals, num_requests)
    requests, warmup = [], []
    for i, off in enumerate(offsets.tolist()):
        spec = specs[i % len(specs)]
        requests.append(SimRequest(off, len(spec.prompt_ids), spec.output_len, spec.kind))
        warmup.append(arrivals.is_warmup(i, off))
    return requests, warmup


def to_records(results: list[SimResult], warmup: list[bool], label: str,
               horizon_s: float | None) -> list[RequestRecord]:
    """Simulated requests as benchmark records (one token per chunk), so the summary is
    computed by exactly the code that summarises a real run."""
    records = []
    for i, (res, warm) in enumerate(zip(results, warmup, strict=True)):
        req, sent = res.request, res.sent_s  # a later turn is sent when the one before ends
        rec = RequestRecord(run=label, index=i, request_id=f"sim-{i}", kind=req.kind,
                            prompt_tokens=req.prompt, max_tokens=req.out,
                            scheduled_s=sent, warmup=warm, send_time=sent)
        if res.ok:
            rec.chunk_offsets = [t - sent for t in res.token_times]
            rec.chunk_tokens = [1] * len(rec.chunk_offsets)
            rec.output_tokens, rec.ok = len(rec.chunk_offsets), True
            rec.e2e_s = res.end_s - sent
            rec.finish_reason = "length"
        else:
            end = horizon_s if horizon_s is not None else res.end_s
            rec.e2e_s, rec.error_code = max(0.0, end - sent), "DEADLINE_EXCEEDED"
        records.append(rec)
    return records


@dataclass(slots=True)
class Prediction:
    """One configuration at one rate."""

    config: str
    rate: float
    summary: dict[str, Any]  # the benchmark summary under the primary SLOs
    goodput_also: float | None = None  # goodput under the second SLO family, if any
    shipped_share: float = 0.0
    utilization: dict[str, float] = field(default_factory=dict)
    computed_tokens: int = 0  # prompt tokens the engines computed (not cached, not shipped)
    shipped_bytes: float = 0.0  # KV bytes the decode workers received

    def row(self) -> dict[str, Any]:
        s = self.summary
        out: dict[str, Any] = {"config": self.config, "rate": self.rate,
                               "completed": s["completed"], "requests": s["requests"],
                               "goodput": s["goodput"], "goodput_share": s["goodput_share"],
                               "goodput_also": self.goodput_also,
                               "shipped_share": self.shipped_share,
                               "utilization": self.utilization}
        for key in SUMMARY_KEYS:
            for p in ("p50", "p90", "p99"):
                out[f"{key.removesuffix('_s')}_{p}"] = s[key][p]
        return out


def simulate(cfg: FleetConfig, profile: Profile, requests: list[SimRequest],
             warmup: list[bool], rate: float, horizon_s: float | None, slos: SLOs,
             also: SLOs | None = None) -> Prediction:
    """One configuration over one schedule."""
    fleet = Fleet(cfg, profile)
    results = fleet.run(requests, horizon_s)
    records = to_records(results, warmup, f"{cfg.name}@{rate:g}", horizon_s)
    summary = summarize(records, slos)
    shipped = sum(1 for r in results if r.path == "shipped")
    span = max((r.end_s for r in results), default=0.0)
    return Prediction(cfg.name, rate, summary,
                      summarize(records, also)["goodput"] if also else None,
                      shipped / max(1, len(results)), fleet.utilization(span),
                      fleet.computed_tokens, fleet.shipped_bytes)


def predict_all(configs: list[FleetConfig], profile: Profile, workload: WorkloadConfig,
                arrivals: ArrivalConfig, rates: list[float], num_requests: int, slos: SLOs,
                also: SLOs | None = None, drain_s: float = 30.0, progress: bool = False,
                tokenizer: Tokenizer | None = None) -> tuple[list[Prediction], float]:
    """Every configuration at every rate (one schedule per rate, shared by all
    configurations); returns the predictions and the seconds taken."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    horizon = arrivals.duration_s + drain_s if arrivals.duration_s is not None else None
    schedules = {r: schedule(workload, replace(arrivals, rate=r), num_requests, tokenizer)
                 for r in rates}
    jobs = [(c, r) for c in configs for r in rates]
    # The bar is closed on the way out, an interrupt included: closed later by the garbage
    # collector, it would redraw itself under the shell's next prompt.
    with tqdm(jobs, desc="simulating", disable=not progress, unit="run") as bar:
        out = [simulate(c, profile, *schedules[r], r, horizon, slos, also) for c, r in bar]
    return out, time.perf_counter() - t0


def slo_attainment(results: list[SimResult], warmup: list[bool], slos: SLOs) -> float:
    """Share of the measured requests within the TTFT and TPOT bounds, from first and
    last token times only (what ``Fleet.run(light=True)`` keeps)."""
    measured = [r for r, w in zip(results, warmup, strict=True) if not w]
    good = 0
    for res in measured:
        if not res.ok or not res.token_times:
            continue
        ttft = res.token_times[0] - res.sent_s
        n = res.request.out
        tpot = (res.token_times[-1] - res.token_times[0]) / (n - 1) if n > 1 else None
        if slos.ttft_s is not None and ttft > slos.ttft_s:
            continue
        if slos.tpot_s is not None and tpot is not None and tpot > slos.tpot_s:
            continue
        good += 1
    return good / len(measured) if measured else 0.0


def rank(predictions: list[Prediction]) -> list[tuple[str, float, list[float]]]:
    """Configurations by total goodput over the rates, best first: (name, total, per
    rate). Ties go to the configuration listed first (the simpler one)."""
    names = list(dict.fromkeys(p.config for p in predictions))
    table = {n: [p.summary["goodput"] for p in predictions if p.config == n] for n in names}
    order = sorted(names, key=lambda n: (-round(sum(table[n]), 9), names.index(n)))
    return [(n, sum(table[n]), table[n]) for n in order]


# Configurations within this share of the first choice's goodput cannot be told apart
# by the simulation: the margin sits above the planner's error against real runs
# (BENCHMARKS.md, "Planner"), which grows as the host drifts from its profile.
CLOSE_CALL = 0.2


def close_calls(ranking: list[tuple[str, float, list[float]]],
                margin: float = CLOSE_CALL) -> list[str]:
    """The configurations after the first whose total goodput is within ``margin`` of it."""
    if not ranking or ranking[0][1] <= 0:
        return []
    best = ranking[0][1]
    return [name for name, total, _ in ranking[1:] if total >= (1 - margin) * best]


def best_per_rate(predictions: list[Prediction]) -> dict[float, str]:
    """The configuration with the most goodput at each rate (ties: listed first)."""
    best: dict[float, Prediction] = {}
    for p in predictions:
        if p.rate not in best or p.summary["goodput"] > best[p.rate].summary["goodput"] + 1e-9:
            best[p.rate] = p
    return {rate: p.config for rate, p in best.items()}
