"""`pdserve plan predict` finds its profile: a file, or a shipped profile by name; without
one it says in one line how to get one."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main
from services.plan.cli import shipped_profiles

WORKLOAD = ["--vocab-size", "1000", "--input-len", "64", "--output-len", "16",
            "--rates", "1", "--duration", "5", "--no-progress"]


def test_predict_without_a_profile_names_the_command_and_the_shipped_profiles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # no bench-results/plan/profile.json here
    assert main(["plan", "predict", *WORKLOAD]) != 0
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert "bench-results/plan/profile.json" in line
    assert "`pdserve plan profile`" in line and "llama-3.1-8b-h100" in line
    assert "Traceback" not in err and "Errno" not in line


def test_predict_names_the_profile_it_was_given_when_missing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "mine.json"
    assert main(["plan", "predict", "--profile", str(missing), *WORKLOAD]) != 0
    (line,) = capsys.readouterr().err.splitlines()
    assert f"`pdserve plan profile --out {missing}`" in line


def test_a_shipped_profile_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert "llama-3.1-8b-h100" in shipped_profiles()
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "predict", "--profile", "llama-3.1-8b-h100", *WORKLOAD]) == 0
    assert "recommended:" in capsys.readouterr().out
