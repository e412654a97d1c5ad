"""Every runnable code block of README.md and docs/*.md, run as a reader pastes it.

Bash blocks run with `bash`, Python blocks with this environment's interpreter, each in one
scratch copy of the repository root (symlinks to its entries: files a block writes stay out
of the checkout), with `.venv/bin` first on PATH. They run against one stack, started once
with the README's own `pdserve up` command on its ports (50051, 8000). A block that starts
and stops a stack of its own (`pdserve demo`, which `make run` runs) runs before that stack
starts; a block that stops it (`pdserve down`) runs last; a block identical to one already
run is not run again. Markers (tests/helpers/doc_blocks.py) say what is not run and why;
a block shown as the `output of the block above` is compared with that block's output.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.api.client import PdserveClient
from tests.helpers.doc_blocks import ROOT, Block, collect, expected_outputs, shape_mismatch
from tests.helpers.servers import stop_group

pytestmark = [pytest.mark.engine, pytest.mark.slow]
UP = "pdserve up --prefill 1 --decode 1 --port 50051 --http-port 8000"
PORTS = (50051, 8000)
BLOCK_TIMEOUT_S = 400


def _runnable() -> tuple[list[Block], list[Block], dict[str, str]]:
    """(blocks that start a stack of their own, blocks run against the stack, the output
    each block is shown to print, by its place)."""
    blocks, _ = collect()
    seen: set[str] = set()
    alone: list[Block] = []
    with_stack: list[Block] = []
    for block in blocks:
        if not block.runs or block.script in seen:
            continue
        seen.add(block.script)
        (alone if "pdserve demo" in block.script else with_stack).append(block)
    with_stack.sort(key=lambda b: "pdserve down" in b.script)  # stable: the rest in order
    return alone, with_stack, expected_outputs(blocks)


ALONE, WITH_STACK, EXPECTED = _runnable()


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch repository root: the checkout's entries as symlinks, no outputs of its own."""
    root = tmp_path_factory.mktemp("docs")
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "bench-results", "site"):
            (root / entry.name).symlink_to(entry)
    return root


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    state = tmp_path_factory.mktemp("docs-state") / "up.json"
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PDSERVE_STATE_FILE": str(state), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
async def stack(model_path: Path, workdir: Path, env: dict[str, str],
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[None]:
    """The README's `pdserve up`, as written, until the module ends (or `pdserve down`)."""
    assert f".venv/bin/{UP}" in (ROOT / "README.md").read_text(), "the README changed its stack"
    for port in PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} is taken: the docs' examples need it free")
    log = tmp_path_factory.mktemp("docs-up") / "up.log"
    proc = subprocess.Popen(["bash", "-c", f".venv/bin/{UP}"], cwd=workdir, env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        async with PdserveClient("127.0.0.1:50051") as client:
            while not await _serving(client):
                if proc.poll() is not None:
                    pytest.fail(f"`{UP}` exited {proc.returncode}:\n{log.read_text()[-4000:]}")
                await asyncio.sleep(1)
        yield
    finally:
        stop_group(proc, timeout=120)


async def _serving(client: PdserveClient) -> bool:
    try:
        return await client.health(timeout=1.0) == "SERVING"
    except Exception:  # not listening yet
        return False


def run(block: Block, workdir: Path, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-c", block.script] if block.lang == "python" else \
        ["bash", "-e", "-o", "pipefail", "-c", block.script]
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0, (
        f"{block.where} exited {done.returncode}:\n{block.script}\n"
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
    if block.where in EXPECTED:
        problem = shape_mismatch(EXPECTED[block.where], done.stdout)
        assert problem is None, f"{block.where}: {problem}\nstdout:\n{done.stdout[-3000:]}"


@pytest.mark.parametrize("block", ALONE, ids=_ids(ALONE))
def test_block_with_a_stack_of_its_own(block: Block, model_path: Path, workdir: Path,
                                       env: dict[str, str]) -> None:
    run(block, workdir, env)


@pytest.mark.parametrize("block", WITH_STACK, ids=_ids(WITH_STACK))
def test_block(block: Block, stack: None, workdir: Path, env: dict[str, str]) -> None:
    run(block, workdir, env)


def test_blocks_are_found() -> None:
    assert len(WITH_STACK) >= 10 and ALONE, (ALONE, WITH_STACK)
