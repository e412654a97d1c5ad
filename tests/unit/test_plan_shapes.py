"""The planner's tensor-parallel shapes and speculative decoding (services/plan/shapes.py):
the cost model's scaling with TP, the all-reduce term, memory feasibility, the per-rank
KV transfer, the ranking and `pdserve plan predict --model` (pure logic on datasheet
figures: no engine, no GPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from services.cli import main
from services.plan.fleet import Fleet, SimRequest
from services.plan.predict import predict_all
from services.plan.shapes import (
    GPUS,
    MODELS,
    Shape,
    SpecDecode,
    allreduce_s,
    enumerate_shapes,
    fit,
    kv_transfer_s,
    plan_shapes,
    profile_for,
    rank_shapes,
    step_cost,
)
from services.traffic.arrivals import ArrivalConfig
from services.traffic.slo import SLOs
from services.traffic.workload import LengthDist, WorkloadConfig

L70 = MODELS["llama-3.3-70b-fp8"]
L70_BF16 = MODELS["llama-3.3-70b"]
H100, H200 = GPUS["h100"], GPUS["h200"]
WORKLOAD = WorkloadConfig(dataset="random", num_requests=60, input_len=LengthDist(2048),
                          output_len=LengthDist(64), seed=0)
ARRIVALS = ArrivalConfig(rate=1.0, duration_s=15, seed=0)


def test_tp_halves_the_weights_each_rank_holds() -> None:
    for tp in (1, 2, 4):
        a, b = fit(L70, H200, tp, 1000), fit(L70, H200, 2 * tp, 1000)
        assert b.weight_bytes_rank == pytest.approx(a.weight_bytes_rank / 2)
    # ... so a decode step reads half the weights per rank
    c2, c4 = step_cost(L70, H100, 2), step_cost(L70, H100, 4)
    assert c4.decode_context_s == pytest.approx(c2.decode_context_s / 2)
    assert c4.base_s < c2.base_s


def test_the_all_reduce_vanishes_at_tp1_and_grows_with_tp() -> None:
    message = 4096 * L70.hidden * L70.act_bytes  # a 4096-token prefill step's activations
    assert allreduce_s(1, message, H100) == 0.0
    times = [allreduce_s(tp, message, H100) for tp in (2, 4, 8)]
    assert times == sorted(times) and times[0] > 0
    assert allreduce_s(8, 0.0, H100) == pytest.approx(14 * H100.link_latency_s)  # 2(t-1) hops
    # In the step cost: at TP 1 a token costs its FLOPs only; above, the all-reduce adds to
    # what the split FLOPs cost, so two TP-2 ranks take longer than half of one TP-1 rank.
    c1, c2 = step_cost(L70, H200, 1), step_cost(L70, H200, 2)
    flops_only = 2 * L70.matmul_params / (H200.fp8_flops * H200.mfu)
    assert c1.prefill_token_s == pytest.approx(flops_only)
    assert c2.prefill_token_s > c1.prefill_token_s / 2
    slow = dataclasses.replace(H200, link_bytes_per_s=H200.link_bytes_per_s / 10)
    assert step_cost(L70, slow, 2).prefill_token_s > c2.prefill_token_s
    assert step_cost(L70, slow, 1).prefill_token_s == c1.prefill_token_s


def test_a_70b_model_does_not_fit_tp1_on_one_80gb_gpu() -> None:
    bf16 = fit(L70_BF16, H100, 1, 1000)
    assert not bf16.ok and "weights need 131.4 GiB per rank at TP 1" in bf16.reason
    fp8 = fit(L70, H100, 1, 8192)  # the FP8 weights fit, with no room for one prompt's KV
    assert not fp8.ok and "GiB left after the weights" in fp8.reason
    assert fit(L70, H100, 2, 8192, 8).ok
    assert fit(L70, H200, 1, 8192, 8).ok  # 141 GB: llm-d's TP-1 prefill workers fit


def test_infeasible_shapes_are_refused_with_their_reason() -> None:
    odd = fit(L70, H100, 3, 1000)
    assert not odd.ok and "do not split over 3 ranks" in odd.reason
    wide = fit(L70, H100, 16, 1000)
    assert not wide.ok and "spans nodes" in wide.reason
    plan = plan_shapes(L70, H100, 8, (1, 2), (1, 4), longest=8448)
    refused = {(b["role"], b["tp"]): b["reason"] for b in plan.infeasible}
    assert set(refused) == {("prefill", 1), ("decode", 1)}
    assert all("use a larger TP" in r for r in refused.values())
    for cfg in plan.configs:  # nothing refused is simulated
        assert cfg.decode.units != 1 and (cfg.prefill is None or cfg.prefill.units != 1)
    assert plan.configs and all(plan.shapes[c.name].gpus <= 8 for c in plan.configs)


def test_kv_capacity_grows_with_tp() -> None:
    kv = [fit(L70, H100, tp, 1000).kv_tokens for tp in (2, 4, 8)]
    assert kv == sorted(kv) and kv[1] > 2 * kv[0]  # weights shrink and heads split


def test_each_decode_rank_receives_its_heads_in_parallel() -> None:
    tokens = 8192
    whole = kv_transfer_s(L70, H100, 1, 1, tokens)
    assert whole == pytest.approx(H100.rdma_latency_s + tokens * L70.kv_bytes_per_token()
                                  / H100.rdma_bytes_per_s)
    # TP 4 to TP 4: a quarter of the heads per rank pair, at once
    assert kv_transfer_s(L70, H100, 4, 4, tokens) == pytest.approx(
        H100.rdma_latency_s + tokens * L70.kv_bytes_per_token() / 4 / H100.rdma_bytes_per_s)
    # TP 8 prefill into TP 2 decode: each decode rank takes 4 pieces of one head
    assert kv_transfer_s(L70, H100, 8, 2, tokens) == pytest.approx(
        4 * H100.rdma_latency_s + tokens * L70.kv_bytes_per_token() / 2
        / H100.rdma_bytes_per_s)
    # a TP-1 prefill worker sends every head through its one NIC whatever the decode TP
    assert kv_transfer_s(L70, H100, 1, 4, tokens) > kv_transfer_s(L70, H100, 4, 4, tokens)


def test_the_fleet_ships_kv_with_the_shapes_transfer() -> None:
    slow = dataclasses.replace(H200, rdma_bytes_per_s=1e9)  # the transfer outlasts prefill
    for a in (1, 4):
        plan = plan_shapes(L70, slow, 8, (a,), (4,), longest=4096)
        cfg = next(c for c in plan.configs if c.prefill is not None)
        (res,) = Fleet(cfg, profile_for(L70, slow)).run([SimRequest(0.0, 4000, 3)])
        transfer = kv_transfer_s(L70, slow, a, 4, 4000)
        assert res.path == "shipped" and transfer > res.token_times[0]
        # the 2nd token comes after the KV, within a few decode steps of it
        assert transfer <= res.token_times[1] < transfer + 0.1


def test_shapes_are_enumerated_within_the_gpus_in_a_fixed_order() -> None:
    shapes = enumerate_shapes(8, (1, 2), (2, 4))
    assert shapes == enumerate_shapes(8, (2, 1), (4, 2))
    assert all(s.gpus <= 8 for s in shapes)
    names = [s.name for s in shapes]
    assert len(names) == len(set(names))
    assert {"colocated_tp2x4", "colocated_tp4x2", "disagg_p2x2_d4x1",
            "disagg_p1x4_d4x1", "disagg_p1x6_d2x1"} <= set(names)
    both = enumerate_shapes(8, (2,), (4,), (False, True))
    assert [s.spec for s in both].count(True) == len(both) // 2


def _predict(spec_modes: tuple[bool, ...], spec: SpecDecode | None = None,
             rates: tuple[float, ...] = (1.0, 2.0)) -> list[dict[str, object]]:
    plan = plan_shapes(L70, H200, 8, (2,), (4,), longest=2112, spec=spec,
                       spec_modes=spec_modes)
    preds, _ = predict_all(plan.configs, profile_for(L70, H200), WORKLOAD, ARRIVALS,
                           list(rates), 60, SLOs(ttft_s=2.0, tpot_s=0.05))
    return rank_shapes([p.row() for p in preds], plan.shapes)


def test_the_ranking_is_deterministic() -> None:
    a, b = _predict((False,)), _predict((False,))
    assert a == b
    per_gpu = [r["goodput_per_gpu"] for r in a]
    assert per_gpu == sorted(per_gpu, reverse=True)
    assert {r["config"] for r in a} == {"colocated_tp4x2", "disagg_p2x2_d4x1",
                                        "disagg_p2x1_d4x1"}


def test_ties_go_to_the_shape_enumerated_first() -> None:
    shapes = {"b": Shape(4, 1, 2, 2), "a": Shape(4, 2)}
    row = {"goodput": 8.0, "rate": 8.0, "ttft_p50": 0.1, "ttft_p99": 0.2, "itl_p50": 0.01,
           "itl_p99": 0.02, "tpot_p50": 0.01}
    ranked = rank_shapes([{**row, "config": "a"}, {**row, "config": "b"}], shapes)
    assert [r["config"] for r in ranked] == ["b", "a"]
    assert ranked[0]["goodput_per_gpu"] == 1.0 and ranked[0]["prefill"] == "TP2 x 2"


def test_spec_decode_lowers_itl_only_when_enabled() -> None:
    spec = SpecDecode(tokens_per_step=2.5, draft_tokens=3, draft_cost=0.1)
    off = {r["config"]: r for r in _predict((False,), rates=(1.0,))}
    assert off == {r["config"]: r for r in _predict((False,), spec, rates=(1.0,))}
    both = {r["config"]: r for r in _predict((False, True), spec, rates=(1.0,))}
    for name, r in off.items():
        assert both[name]["itl_p50"] == r["itl_p50"]  # the off shape is unchanged
        assert both[f"{name}_spec"]["itl_p50"] < r["itl_p50"]
        assert both[f"{name}_spec"]["spec"] == "on"
    # prefill is not sped up: the first token of a shipped request comes as early
    name = "disagg_p2x2_d4x1"
    assert both[f"{name}_spec"]["ttft_p50"] == pytest.approx(off[name]["ttft_p50"], rel=0.05)


def test_spec_decode_that_accepts_nothing_costs_more() -> None:
    base = step_cost(L70, H100, 4)
    idle = SpecDecode(tokens_per_step=1.0, draft_tokens=3, draft_cost=0.1).cost(base)
    assert idle.base_s > base.base_s and idle.decode_seq_s > base.decode_seq_s
    good = SpecDecode(tokens_per_step=3.0, draft_tokens=3, draft_cost=0.1).cost(base)
    assert good.step_s(0, 64, 0.0, 0.5) < base.step_s(0, 64, 0.0, 0.5)
    assert good.prefill_token_s == base.prefill_token_s  # prefill is not sped up
    for bad in (dict(tokens_per_step=5.0, draft_tokens=3), dict(tokens_per_step=0.5),
                dict(draft_tokens=0), dict(draft_cost=-0.1)):
        with pytest.raises(ValueError):
            SpecDecode(**bad)  # type: ignore[arg-type]


ARGS = ["plan", "predict", "--model", "llama-3.3-70b-fp8", "--gpu", "h100", "--units", "8",
        "--prefill-tp", "1,2", "--decode-tp", "4", "--input-len", "2048", "--output-len",
        "64", "--rates", "1", "2", "--duration", "15", "--slo", "ttft=2", "--slo",
        "tpot=0.05", "--no-progress"]


def test_pdserve_plan_predict_ranks_shapes(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "shapes.json"
    assert main([*ARGS, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "infeasible: prefill at TP 1" in text and "PREDICTED" in text
    assert "goodput/GPU" in text and "TP2 x 2" in text
    data = json.loads(out.read_text())
    assert [b["tp"] for b in data["infeasible"]] == [1]
    ranked = data["shapes"]
    assert ranked[0]["config"] == data["recommended"]["config"]
    assert {"prefill", "decode", "spec", "gpus", "goodput_per_gpu", "ttft_p50",
            "itl_p50"} <= set(ranked[0])
    assert "--decode-tp" in data["recommended"]["up"]
    assert data["recommended"]["helm"]["decode"]["tensorParallelSize"] == 4


@pytest.mark.parametrize(("extra", "message"), [
    (["--units", "1"], "no shape of Llama-3.3-70B-Instruct-FP8-dynamic fits 1 x"),
    (["--decode-tp", "0"], "--decode-tp needs tensor-parallel sizes >= 1"),
    (["--spec-decode", "on", "--spec-tokens-per-step", "9"], "tokens per step must be"),
])
def test_bad_shape_requests_say_what_to_do(extra: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, *extra]) == 2
    assert message in capsys.readouterr().err
