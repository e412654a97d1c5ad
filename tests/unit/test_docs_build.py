"""The user guide builds: `mkdocs build --strict` fails on a broken link or anchor, a nav
entry without its page, a page left out of the nav, or any other warning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")  # the dev extra's, beside this Python


def test_the_user_guide_builds_without_warnings(tmp_path: Path) -> None:
    run = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "WARNING" not in run.stderr, run.stderr
    assert (tmp_path / "site" / "index.html").exists()
