"""`pdserve plan profile --quick` with the real engine on this machine, then `plan
predict` on what it measured. One engine, a tiny grid: well under a minute."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.plan.costmodel import Profile

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "plan", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=200)


def test_a_quick_profile_measures_the_engine_and_drives_a_prediction(
        tmp_path: Path, model_path: Path) -> None:
    out = tmp_path / "profile.json"
    done = plan("profile", "--quick", "--no-progress", "--model", str(model_path),
                "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    prof = Profile.load(out)
    assert prof.unit == "core" and prof.hardware["cores"] >= 1
    assert prof.versions["pdserve"] and prof.model["layers"] == 30
    assert prof.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, fp32
    kinds = {s["kind"] for s in prof.samples}
    assert kinds == {"prefill", "decode"}
    assert all(s["seconds"] > 0 for s in prof.samples)
    (units, cost), = prof.step_cost.items()
    assert units == prof.hardware["cores"]
    # a decode step and a prefill are predicted from what was measured, not made up
    decode = next(s for s in prof.samples if s["kind"] == "decode")
    assert cost.step_s(0, decode["batch"], 0.0, 0.0) > 0
    assert prof.transports["grpc"].gb_per_s > 0

    pred = plan("predict", "--profile", str(out), "--dataset", "mixed", "--vocab-size",
                "1000", "--input-len", "64", "--output-len", "16", "--long-share", "0.2",
                "--long-input-len", "400", "--rates", "0.5", "1", "--duration", "20",
                "--slo", "ttft=4", "--slo", "tpot=0.2", "--no-progress",
                "--json", str(tmp_path / "pred.json"))
    assert pred.returncode == 0, pred.stderr[-3000:]
    assert "recommended:" in pred.stdout and "pdserve up --prefill" in pred.stdout
    result = json.loads((tmp_path / "pred.json").read_text())
    assert len(result["predictions"]) == 2 * len(result["ranking"])
