"""Figures of repeated trace replays across server configurations: what one run's
counters and summary give, medians with confidence intervals over the runs, ratios to a
baseline configuration paired run by run, and the planner's view of the same replay
(`benchmarks/trace_routing.py`).

Pure functions of numbers already measured: no server is started here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from services.plan.fleet import FleetConfig, PoolSpec, SimRequest
from services.plan.prefix_cache import block_keys
from services.traffic.intervals import interval

COLOCATED = "colocated"  # one engine on every core: plain vLLM
BASELINE = "round_robin"  # the configuration the ratios are taken to
LOCAL_PREFILL_MAX_TOKENS = 256  # conditional's threshold, for the planner as for the router
# The engines' KV block on CPU (vLLM's default there; the replay's block plan assumes it):
# what a prefix cache holds and the router's index hashes.
KV_BLOCK_TOKENS = 128

COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"
DECODE = ("pdserve_kv_transfer_bytes_total", "pdserve_kv_prompt_bytes_total",
          "pdserve_kv_reused_prefix_tokens_total", "pdserve_kv_reuse_fallbacks_total")
# Figures of one run, and whether a ratio to round robin's same run is reported for it.
FIGURES = (("prompt_tokens_computed", True), ("kv_bytes_shipped", True),
           ("kv_bytes_vs_all_blocks", False), ("ttft_p50_s", True), ("ttft_p99_s", True),
           ("tpot_p50_s", False), ("goodput", False), ("goodput_share", False))
PLANNED = ("ttft_p50_s", "ttft_p99_s", "goodput_share")  # what the planner is checked on



def deltas(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
           ) -> dict[str, float]:
    """One run's totals from counters read before and after it: the engines' computed
    prompt tokens per role (prefill, decode, colocated) and in all, KV bytes."""
    out: dict[str, float] = {"prompt_tokens_computed": 0.0, **{n: 0.0 for n in DECODE}}
    for worker, now in after.items():
        was = before.get(worker, {})
        computed = now[COMPUTED] - was.get(COMPUTED, 0.0)  # not cached, not shipped in
        pool = f"{now['role']}_pool_computed"
        out[pool] = out.get(pool, 0.0) + computed
        out["prompt_tokens_computed"] += computed
        for n in DECODE:
            out[n] += now.get(n, 0.0) - was.get(n, 0.0)
    return out


def run_figures(totals: dict[str, float], summary: dict[str, Any]) -> dict[str, float | None]:
    """The figures of one run, from its counters and its replay summary."""
    prompt_bytes = totals["pdserve_kv_prompt_bytes_total"]
    return {
        "prompt_tokens_computed": totals["prompt_tokens_computed"],
        "kv_bytes_shipped": totals["pdserve_kv_transfer_bytes_total"],
        "kv_bytes_vs_all_blocks": (totals["pdserve_kv_transfer_bytes_total"] / prompt_bytes
                                   if prompt_bytes else None),
        "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
        "tpot_p50_s": summary["tpot_s"]["p50"], "goodput": summary.get("goodput"),
        "goodput_share": summary.get("goodput_share"),
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def summarize_config(runs: Sequence[dict[str, float | None]],
                     base: Sequence[dict[str, float | None]] | None, level: float,
                     method: str) -> dict[str, Any]:
    """Every figure of one configuration over its runs as an interval (median, low,
    high, ...), and for the figures in FIGURES marked so, its ratio to the baseline's
    run of the same index, paired run by run (a run without a partner is left out)."""
    out: dict[str, Any] = {"runs": len(runs)}
    for name, with_ratio in FIGURES:
        values = [v for r in runs if (v := r.get(name)) is not None]
        out[name] = interval(values, level, method).as_dict() if values else None
        if with_ratio and base is not None:
            ratios = [q for r, b in zip(runs, base, strict=False)
                      if (q := _ratio(r.get(name), b.get(name))) is not None]
            out[f"{name}_vs_{BASELINE}"] = (interval(ratios, level, method).as_dict()
                                             if ratios else None)
    return out


# The router behind each configuration of `pdserve up` (the planner's routing.ROUTINGS);
# conditional is precise with short prompts prefilled on the decode worker.
ROUTING = {"round_robin": "round_robin", "approximate": "approximate", "precise": "precise",
           "conditional": "precise"}


def fleet_configs(names: Sequence[str], prefill: int, decode: int, cores: int,
                  stack_steps: tuple[int, int] = (0, 0), engine_kv_tokens: int = 0,
                  block_tokens: int = KV_BLOCK_TOKENS) -> dict[str, FleetConfig]:
    """The planner's picture of each configuration on ``cores`` cores: colocated, one
    engine on all of them at vLLM's own step budget (as `pdserve serve` runs it) with the
    KV cache of all the stack's engines together (``engine_kv_tokens`` each; 0: the
    profile's, and the profile's for the colocated engine too); disaggregated, the launcher's
    split (first half of the cores prefill, second half decode) with ``stack_steps`` =
    (max_num_batched_tokens, long_prefill_token_threshold) as `pdserve up` bounds its
    engines' steps (0: the profile's), routed by the configuration's router (``ROUTING``).
    A pool with more workers than cores runs them time-sharing the cores, as the
    launcher pins them; one with fewer gives each worker an equal part of them. Every
    engine caches prefixes in blocks of ``block_tokens`` tokens (the engines' KV block)."""
    half = max(1, cores // 2)
    budget, threshold = stack_steps

    def pool(workers: int, pool_cores: int) -> PoolSpec:
        if workers > pool_cores:
            if workers % pool_cores:
                raise ValueError(f"{workers} workers cannot share {pool_cores} cores "
                                 "evenly: give a multiple of the cores")
            return PoolSpec(workers, 1, budget, threshold, kv_cache_tokens=engine_kv_tokens,
                            share=workers // pool_cores)
        return PoolSpec(workers, pool_cores // workers, budget, threshold,
                        kv_cache_tokens=engine_kv_tokens)

    out: dict[str, FleetConfig] = {}
    for name in names:
        if name == COLOCATED:
            colocated = PoolSpec(1, cores, kv_cache_tokens=engine_kv_tokens * (prefill + decode))
            out[name] = FleetConfig(name, colocated, block_tokens=block_tokens)
        else:
            local = LOCAL_PREFILL_MAX_TOKENS if name == "conditional" else 0
            out[name] = FleetConfig(name, pool(decode, cores - half), pool(prefill, half),
                                    local_prefill_max_tokens=local,
                                    routing=ROUTING.get(name, "precise"),
                                    block_tokens=block_tokens)
    return out


def planner_requests(at_s: Sequence[float], prompts: Sequence[Sequence[int]],
                     outputs: Sequence[int], after: Sequence[int | None] | None = None,
                     block_tokens: int = KV_BLOCK_TOKENS) -> list[SimRequest]:
    """The replay's requests for the simulation: send times, prompts (drawn as the keys
    of their whole blocks, so each engine's prefix cache finds what it holds of them),
    output lengths, and the earlier turn each follows (``after``; None: none)."""
    follows = after or [None] * len(prompts)
    return [SimRequest(float(t), len(p), o, "trace", block_keys(p, block_tokens), a)
            for t, p, o, a in zip(at_s, prompts, outputs, follows, strict=True)]


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def planner_check(predicted: dict[str, dict[str, float | None]],
                  measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Predicted vs measured (the median of the runs) per configuration and figure, and
    the median absolute relative error over every figure that has one."""
    rows: dict[str, Any] = {}
    errors: list[float] = []
    for name, pred in predicted.items():
        row: dict[str, Any] = {}
        for fig in PLANNED:
            meas = (measured.get(name, {}).get(fig) or {}).get("median")
            err = rel_error(pred.get(fig), meas)
            row[fig] = {"predicted": pred.get(fig), "measured": meas, "error": err}
            if err is not None:
                errors.append(abs(err))
        rows[name] = row
    return {"rows": rows, "median_abs_error": float(np.median(errors)) if errors else None,
            "errors_counted": len(errors)}
