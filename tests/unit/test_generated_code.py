"""The committed gRPC code is what `make proto` makes from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    assert protos
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos],
        cwd=ROOT, check=True,
    )
    generated = sorted(tmp_path.rglob("*_pb2*.py*"))
    assert generated
    stale = [
        str(g.relative_to(tmp_path)) for g in generated
        if not (ROOT / "proto" / g.relative_to(tmp_path)).is_file()
        or (ROOT / "proto" / g.relative_to(tmp_path)).read_bytes() != g.read_bytes()
    ]
    assert not stale, f"generated code is stale, run `make proto`: {stale}"
