"""The figures of repeated trace replays (services/bench/replays.py) and the per-request
prefix reuse a Mooncake replay reports (services/traffic/traces.py): pure logic, no
server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from services.bench.replays import (
    BASELINE,
    COLOCATED,
    COMPUTED,
    deltas,
    fleet_configs,
    planner_check,
    planner_requests,
    run_figures,
    summarize_config,
)
from services.traffic.traces import ReplayConfig, plan_replay

ROWS = [  # request 4 continues request 0; request 5 continues request 4
    {"timestamp": 0, "input_length": 1500, "output_length": 500, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [0, 3, 4]},
    {"timestamp": 1000, "input_length": 300, "output_length": 3, "hash_ids": [0]},
    {"timestamp": 2500, "input_length": 600, "output_length": 20, "hash_ids": [0, 5]},
    {"timestamp": 6000, "input_length": 2000, "output_length": 10, "hash_ids": [0, 1, 6, 7]},
    {"timestamp": 9000, "input_length": 2100, "output_length": 10,
     "hash_ids": [0, 1, 6, 7, 8]},
]


def test_a_mooncake_replay_counts_each_requests_reused_prefix(tmp_path: Path) -> None:
    path = tmp_path / "conversation.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    cfg = ReplayConfig(str(path), max_model_len=1024, kv_block_size=32, length_scale=1 / 16)
    replay = plan_replay(cfg, np.arange(1000))
    specs = replay.specs
    assert [len(s.prompt_ids) for s in specs] == [94, 69, 19, 38, 125, 132]
    # 32-token blocks: request 1 finds block 0; request 2 (19 tokens) is all inside
    # block 0; request 4 finds blocks 0 and 1; request 5 the three whole blocks of
    # request 4 (its fourth, 29 tokens, was not whole: a cache does not keep it)
    assert replay.reused_tokens == [0, 32, 19, 32, 64, 96]
    # the trace's share counts request 5's fourth block, which was sent in part
    assert replay.description["prefix_reuse"]["reused_blocks"] == 9
    # the tokens counted as reused are the same tokens in the earlier prompt
    assert specs[5].prompt_ids[:96] == specs[4].prompt_ids[:96]
    assert specs[4].prompt_ids[:64] == specs[0].prompt_ids[:64]


def test_an_azure_replay_reuses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,374,109\n")
    replay = plan_replay(ReplayConfig(str(path), max_model_len=2048), np.arange(1000))
    assert replay.reused_tokens == [0, 0]


def counters(computed: float, role: str, shipped: float = 0.0) -> dict[str, float | str]:
    return {"role": role, COMPUTED: computed, "pdserve_kv_transfer_bytes_total": shipped,
            "pdserve_kv_prompt_bytes_total": 2 * shipped}


def test_a_runs_totals_are_the_counters_growth_per_role() -> None:
    before = {"p0": counters(100, "prefill"), "d0": counters(10, "decode", 1000)}
    after = {"p0": counters(400, "prefill"), "d0": counters(30, "decode", 5000),
             "p1": counters(50, "prefill")}  # a worker that came up during the run
    totals = deltas(before, after)  # type: ignore[arg-type]
    assert totals["prefill_pool_computed"] == 350
    assert totals["decode_pool_computed"] == 20
    assert totals["prompt_tokens_computed"] == 370
    assert totals["pdserve_kv_transfer_bytes_total"] == 4000
    assert totals["pdserve_kv_prompt_bytes_total"] == 8000


def summary(ttft_p50: float, share: float) -> dict[str, object]:
    return {"ttft_s": {"p50": ttft_p50, "p99": 2 * ttft_p50}, "tpot_s": {"p50": 0.1},
            "goodput": share / 2, "goodput_share": share}


def figures(computed: float, shipped: float, ttft: float) -> dict[str, float | None]:
    totals = {"prompt_tokens_computed": computed, "pdserve_kv_transfer_bytes_total": shipped,
              "pdserve_kv_prompt_bytes_total": 1000.0}
    return run_figures(totals, summary(ttft, 0.5))


def test_ratios_pair_each_run_with_the_baselines_run_of_the_same_index() -> None:
    base = [figures(1000, 1000, 4.0), figures(2000, 1000, 8.0), figures(1000, 500, 4.0)]
    # half of the baseline in every run, though the runs differ twofold between them
    runs = [figures(500, 500, 2.0), figures(1000, 500, 4.0), figures(500, 250, 2.0)]
    out = summarize_config(runs, base, 0.95, "t")
    ratio = out["prompt_tokens_computed_vs_" + BASELINE]
    assert ratio["median"] == pytest.approx(0.5)
    assert ratio["low"] == pytest.approx(0.5) and ratio["high"] == pytest.approx(0.5)
    assert out["kv_bytes_shipped_vs_" + BASELINE]["median"] == pytest.approx(0.5)
    assert out["ttft_p99_s_vs_" + BASELINE]["median"] == pytest.approx(0.5)
    # the figure itself keeps its run-to-run spread
    computed = out["prompt_tokens_computed"]
    assert computed["median"] == 500 and computed["low"] < 500 < computed["high"]
    assert out["kv_bytes_vs_all_blocks"]["median"] == pytest.approx(0.5)
    assert out["runs"] == 3 and "goodput_share_vs_" + BASELINE not in out


def test_a_ratio_without_a_baseline_value_is_left_out() -> None:
    base = [figures(0, 0, 4.0), figures(1000, 1000, 4.0)]
    out = summarize_config([figures(10, 10, 4.0), figures(500, 500, 4.0)], base, 0.95, "t")
    assert out["prompt_tokens_computed_vs_" + BASELINE]["n"] == 1
    assert out["prompt_tokens_computed_vs_" + BASELINE]["median"] == pytest.approx(0.5)
    no_base = summarize_config([figures(10, 10, 4.0)], None, 0.95, "t")
    assert "prompt_tokens_computed_vs_" + BASELINE not in no_base


def test_the_planners_fleets_on_two_cores() -> None:
    fleets = fleet_configs([COLOCATED, "round_robin", "approximate", "conditional"], 2, 2, 2,
                           engine_kv_tokens=1000)
    assert fleets[COLOCATED].prefill is None and fleets[COLOCATED].decode.units == 2
    # the colocated engine has the KV cache of the four engines together
    assert fleets[COLOCATED].decode.kv_cache_tokens == 4000
    rr = fleets["round_robin"]
    # two workers pinned to one core: two engines time-sharing it
    assert rr.prefill is not None
    assert (rr.prefill.engines, rr.prefill.units, rr.prefill.share) == (2, 1, 2)
    assert (rr.decode.engines, rr.decode.units, rr.decode.share) == (2, 1, 2)
    assert rr.units == 2 and rr.decode.kv_cache_tokens == 1000
    assert rr.local_prefill_max_tokens == 0
    assert [fleets[n].routing for n in ("round_robin", "approximate", "conditional")] == [
        "round_robin", "approximate", "precise"]
    assert fleets[COLOCATED].routing == ""
    assert fleets["conditional"].local_prefill_max_tokens == 256
    assert rr.prefill.max_num_batched_tokens == 0  # the profile's budget unless given
    wide = fleet_configs([COLOCATED, "precise"], 2, 1, 8, (512, 256))
    precise = wide["precise"]
    assert precise.prefill is not None
    assert (precise.prefill.engines, precise.prefill.units, precise.prefill.share) == (2, 2, 1)
    assert (precise.decode.engines, precise.decode.units) == (1, 4)
    # `pdserve up`'s step bounds apply to the stack's pools, not to `serve`'s one engine
    assert (precise.prefill.max_num_batched_tokens,
            precise.prefill.long_prefill_token_threshold) == (512, 256)
    assert precise.decode.max_num_batched_tokens == 512
    assert wide[COLOCATED].decode.max_num_batched_tokens == 0
    with pytest.raises(ValueError, match="multiple of the cores"):
        fleet_configs(["precise"], 3, 2, 4)


def test_planner_requests_carry_their_blocks_and_turn_order() -> None:
    first = list(range(300))
    later = first[:256] + [7] * 44  # the same two whole blocks, then its own
    reqs = planner_requests([0.0, 1.5], [first, later], [10, 4], [None, 0], block_tokens=128)
    assert [(r.send_s, r.prompt, r.out, r.after) for r in reqs] == [(0.0, 300, 10, None),
                                                                     (1.5, 300, 4, 0)]
    assert len(reqs[0].blocks) == 2 and reqs[1].blocks == reqs[0].blocks
    alone = planner_requests([0.0], [[9] * 127], [1])
    assert alone[0].blocks == () and alone[0].after is None  # no whole block: no key


def test_planner_error_is_the_median_over_figures_with_a_measurement() -> None:
    measured = {"a": {"ttft_p50_s": {"median": 2.0}, "ttft_p99_s": {"median": 4.0},
                      "goodput_share": {"median": 0.0}},
                "b": {"ttft_p50_s": {"median": 1.0}, "ttft_p99_s": None,
                      "goodput_share": {"median": 0.5}}}
    predicted = {"a": {"ttft_p50_s": 2.2, "ttft_p99_s": 3.0, "goodput_share": 1.0},
                 "b": {"ttft_p50_s": 1.5, "ttft_p99_s": 9.0, "goodput_share": 0.5}}
    check = planner_check(predicted, measured)  # type: ignore[arg-type]
    assert check["rows"]["a"]["ttft_p50_s"]["error"] == pytest.approx(0.1)
    assert check["rows"]["a"]["goodput_share"]["error"] is None  # measured 0: no ratio
    assert check["rows"]["b"]["ttft_p99_s"]["measured"] is None
    # |errors|: 0.1, 0.25, 0.5, 0.0
    assert check["errors_counted"] == 4
    assert check["median_abs_error"] == pytest.approx(0.175)


def test_conversations_can_be_drawn_from_the_multi_turn_ones_only(tmp_path: Path) -> None:
    from services.traffic.traces import read_trace, sample_conversations

    path = tmp_path / "conversation.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    records = read_trace(path).records
    # request 0 has two later turns (4, then 5); every other request stands alone
    picked = sample_conversations(records, 5, seed=1, min_turns=3)
    assert [r.line for r in picked] == [1, 5, 6]
    # min_turns 1 is the plain draw, the same conversations for the same seed
    assert sample_conversations(records, 2, seed=3, min_turns=1) == sample_conversations(
        records, 2, seed=3)
    with pytest.raises(ValueError, match="no conversation of the window has 4 turns"):
        sample_conversations(records, 1, min_turns=4)
