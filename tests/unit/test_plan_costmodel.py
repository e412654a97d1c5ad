"""The cost model: features, the non-negative fit, JSON, and the recommendation's flags
and Helm keys (pure logic)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from services.plan.configs import configurations, helm_values, to_yaml, up_flags
from services.plan.costmodel import (
    Profile,
    StepCost,
    Transport,
    decode_features,
    fit_step_cost,
    nnls,
    prefill_features,
)

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_features_add_up_the_chunks() -> None:
    f = prefill_features(250, 100)
    assert f[0] == 3 and f[1] == 250 and f[5] == 1  # steps, tokens, one request
    # attention: 100 tokens after 0, 100 after 100, 50 after 200 (pairs / 1e6)
    pairs = (100 * 101 / 2) + (100 * 100 + 100 * 101 / 2) + (50 * 200 + 50 * 51 / 2)
    assert f[3] == pytest.approx(pairs / 1e6)


def test_the_fit_recovers_the_coefficients_it_was_made_with() -> None:
    truth = StepCost(0.02, 0.001, 0.003, 0.4, 0.05, 0.01)
    rng = np.random.default_rng(0)
    samples = []
    for length in (16, 64, 256, 1024, 1800):
        for budget in (256, 2048):
            f = prefill_features(length, budget)
            samples.append({"features": f.tolist(), "seconds": float(f @ truth.coefficients())})
    for batch in (1, 4, 16):
        for ctx in (64, 512, 1024):
            f = decode_features(batch, ctx)
            samples.append({"features": f.tolist(),
                            "seconds": float(f @ truth.coefficients()) * rng.uniform(1, 1.001)})
    fitted, quality = fit_step_cost(samples)
    assert np.allclose(fitted.coefficients(), truth.coefficients(), rtol=0.05, atol=1e-4)
    assert quality["median_abs_rel_error"] < 0.01


def test_nnls_never_returns_a_negative_cost() -> None:
    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])  # a falling line: the slope would be negative
    coef = nnls(x, y)
    assert (coef >= 0).all() and coef[1] == 0


def fake_profile(unit: str = "core") -> Profile:
    """A made-up profile (a fake: chosen numbers)."""
    cost = StepCost(0.03, 0.001, 0.002, 0.5, 0.01, 0.01)
    return Profile({"kind": "cpu"}, {"name": "fake", "layers": 30}, {"pdserve": "0"}, unit,
                   {1: cost, 2: cost}, {"grpc": Transport(0.6, 1.5)}, 2048, 64, 46080, 40000,
                   2, sources=[{"what": "nothing", "source": "made up"}])


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    prof = fake_profile()
    prof.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again == prof
    assert again.cost(2) is not None and again.cost(8) == again.step_cost[2]  # nearest size


def test_a_file_of_another_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="pdserve-plan-profile"):
        Profile.load(tmp_path / "p.json")


def test_flags_and_helm_values_of_a_conditional_split() -> None:
    prof = fake_profile()
    cfg = next(c for c in configurations(prof, 2) if c.name == "conditional_1p1d_t256")
    assert up_flags(cfg, prof) == [
        "pdserve", "up", "--prefill", "1", "--decode", "1", "--max-num-batched-tokens", "0",
        "--long-prefill-token-threshold", "0", "--local-prefill-max-tokens",
        "256", "--kv-transport", "grpc", "--prefill-cores", "0", "--decode-cores", "1"]
    values = helm_values(cfg, prof)
    assert values["router"]["settings"]["local_prefill_max_tokens"] == 256
    assert yaml.safe_load(to_yaml(values)) == values


def test_helm_values_use_the_charts_own_keys() -> None:
    chart = yaml.safe_load((ROOT / "helm/pdserve/values.yaml").read_text())
    prof = fake_profile()
    for cfg in configurations(prof, 2):
        for role, block in helm_values(cfg, prof).items():
            assert role in chart, role
            for key in block:
                assert key in chart[role] or role in ("engine", "worker"), (role, key)
    tuned = next(c for c in configurations(prof, 2) if c.name == "colocated_b256")
    assert up_flags(tuned, prof)[:6] == ["pdserve", "up", "--prefill", "0", "--decode", "1"]
    assert helm_values(tuned, prof)["engine"] == {"max_num_batched_tokens": 256}


def test_a_capped_budget_reaches_the_flags_and_the_chart() -> None:
    import dataclasses

    from services.engine.config import EngineConfig

    prof = fake_profile()
    base = next(c for c in configurations(prof, 2) if c.name == "colocated_b256")
    cfg = dataclasses.replace(base, decode=dataclasses.replace(
        base.decode, max_num_batched_tokens=512, long_prefill_token_threshold=256))
    flags = up_flags(cfg, prof)
    assert flags[flags.index("--long-prefill-token-threshold") + 1] == "256"
    engine = helm_values(cfg, prof)["engine"]
    assert engine == {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 256}
    EngineConfig(**engine)  # the chart's engine block takes EngineConfig's own names


def test_the_one_core_profile_engine_runs_with_a_decode_workers_connector() -> None:
    from services.engine.config import EngineConfig
    from services.plan.profile import _decode_connector

    cfg = EngineConfig.model_validate({"kv_cache_gib": 1})
    kv = _decode_connector(cfg)
    assert kv.kv_connector == "PdserveConnector" and kv.kv_role == "kv_consumer"
    extra = kv.kv_connector_extra_config
    assert extra["kv_host"] == "127.0.0.1" and extra["max_staged_bytes"] == 1 << 30
