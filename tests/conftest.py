"""Shared fixtures: engines are expensive (~30-60 s to start on a CPU), so each kind of
server starts once per test session and every test shares it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.registry.redis_server import RedisServer
from tests.helpers.prompts import TEXT_PROMPTS
from tests.helpers.servers import DisaggStack, ServerProcess

REFERENCE_MAX_TOKENS = 24


@pytest.fixture(scope="session")
def model_path() -> Path:
    from services.engine.model import prepare_default_model

    return prepare_default_model().path


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pdserve")


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="session")
def offline_reference_proc(
    model_path: Path, session_dir: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """vLLM's offline LLM.generate on TEXT_PROMPTS, started early in its own process so
    it loads while the servers start."""
    prompts = session_dir / "prompts.json"
    prompts.write_text(json.dumps(TEXT_PROMPTS))
    out = session_dir / "reference.json"
    log = (session_dir / "reference.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.offline_reference", str(model_path),
         str(prompts), str(out), str(REFERENCE_MAX_TOKENS)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    yield proc, out
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="session")
def offline_reference(offline_reference_proc: tuple[subprocess.Popen[bytes], Path],
                      session_dir: Path) -> list[dict]:
    proc, out = offline_reference_proc
    if proc.wait(timeout=600) != 0:
        raise RuntimeError((session_dir / "reference.log").read_text()[-4000:])
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
async def colocated(model_path: Path, session_dir: Path,
                    offline_reference_proc: object) -> AsyncIterator[ServerProcess]:
    server = ServerProcess(["--mode", "colocated", "--kv-cache-gib", "1"],
                           session_dir / "colocated.log")
    async with server.running():
        yield server


async def start_disagg(session_dir: Path, transport: str, *extra: str,
                       ) -> AsyncIterator[DisaggStack]:
    stack = DisaggStack.create(session_dir / f"disagg-{transport}.log", transport, *extra)
    async with stack.server.running(timeout=600):
        yield stack


@pytest.fixture(scope="module")
async def disagg_grpc(model_path: Path, session_dir: Path) -> AsyncIterator[DisaggStack]:
    # Without the engines' schedulers pinned (the default pins them: the torch stack).
    async for stack in start_disagg(session_dir, "grpc", "--no-pin-scheduler"):
        yield stack


@pytest.fixture(scope="module")
async def disagg_torch(model_path: Path, session_dir: Path) -> AsyncIterator[DisaggStack]:
    async for stack in start_disagg(session_dir, "torch"):
        yield stack


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, for one test module."""
    server = RedisServer().start()
    yield server
    server.cleanup()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped, and say so, where no CUDA GPU is visible
    (`make gpu-check` runs them on a GPU machine)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (`make gpu-check` on a GPU machine)")
    for item in gpu:
        item.add_marker(skip)
