"""What a user meets first with a real colocated server: Ctrl-C on the client commands
(one line, exit code 130, the request aborted on the server) and the engine's first
logprobs request (compiled for at start-up, not while the user waits)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pdserve.v1 import generate_pb2 as pb
from services.api.client import PdserveClient, build_request, collect
from tests.helpers.servers import ServerProcess, scrape

pytestmark = pytest.mark.engine

# Long enough that the answer is still streaming when Ctrl-C comes.
LONG = ["Count from 1 to 1000, separated by commas:", "--temperature", "0", "--max-tokens", "1800"]


@pytest.fixture(scope="module")
def inductor_cache(session_dir: Path) -> Path:
    return session_dir / "inductor-first-use"


@pytest.fixture(scope="module")
async def server(
    model_path: Path, session_dir: Path, inductor_cache: Path
) -> AsyncIterator[ServerProcess]:
    # torch.compile's output in a folder of this server's own: what its engine compiles
    # shows there as new files.
    server = ServerProcess(
        ["--mode", "colocated", "--kv-cache-gib", "1"],
        session_dir / "first-use.log",
        env={"TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)},
    )
    async with server.running():
        yield server


def compiled(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}


def logprobs_request(i: int) -> pb.GenerateRequest:
    return build_request(
        text=f"Hello {i}", temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True
    )


async def test_first_logprobs_requests_compile_nothing_new(
    server: ServerProcess, inductor_cache: Path
) -> None:
    before = compiled(inductor_cache)
    assert before, "the warm-up compiled nothing: is TORCHINDUCTOR_CACHE_DIR still honoured?"
    assert "engine warmed up" in server.log_path.read_text()
    async with PdserveClient(server.target) as client:
        alone = await collect(client.call(logprobs_request(0)))
        together = await asyncio.gather(
            *(collect(client.call(logprobs_request(i))) for i in (1, 2, 3))
        )
    assert all(len(r.token_ids) == 6 for r in (alone, *together))
    assert compiled(inductor_cache) == before


# A test run in the background inherits SIGINT ignored, which Python keeps; a user's
# shell does not. The child restores Ctrl-C itself: a `preexec_fn` would make
# subprocess fork() this process, whose gRPC threads may be mid-call, and the child
# can then abort inside gRPC's fork handlers before it ever runs pdserve.
_WITH_CTRL_C = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "from services.cli import main; sys.exit(main(sys.argv[1:]))")


def pdserve(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", _WITH_CTRL_C, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def interrupted(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C: one line, exit code 130."""
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    text = err.decode(errors="replace")
    assert proc.returncode == 130, text
    assert "Traceback" not in text
    assert text.strip().splitlines() == ["interrupted"]


def finished(server: ServerProcess) -> float:
    """Requests the engine finished by stop or length (not aborted)."""
    return sum(
        scrape(server.metrics_port, finished_reason=r).get("vllm:request_success_total", 0.0)
        for r in ("stop", "length")
    )


async def engine_idle(server: ServerProcess) -> None:
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return
        assert time.monotonic() < deadline, f"still running: {m['vllm:num_requests_running']}"
        await asyncio.sleep(0.25)


async def wait_running(server: ServerProcess, proc: subprocess.Popen[bytes]) -> None:
    while server.metrics()["vllm:num_requests_running"] < 1:
        assert proc.poll() is None, proc.communicate()
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("json_output", [False, True], ids=["stream", "json"])
async def test_ctrl_c_on_generate_says_one_line_and_aborts_the_request(
    server: ServerProcess, json_output: bool
) -> None:
    done_before = finished(server)
    proc = pdserve(
        "generate", *LONG, "--target", server.target, *(["--json"] if json_output else [])
    )
    assert proc.stdout is not None
    if not json_output:
        assert await asyncio.to_thread(proc.stdout.read, 1), "no tokens streamed"
    await wait_running(server, proc)
    interrupted(proc)
    await engine_idle(server)
    # aborted there, not run to its end
    assert finished(server) == done_before


@pytest.fixture
def silent_server() -> Iterator[socket.socket]:
    """A port that accepts connections and never answers: how a wedged server looks."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener


async def test_ctrl_c_on_info_waiting_for_an_answer(silent_server: socket.socket) -> None:
    port = silent_server.getsockname()[1]
    proc = pdserve("info", "--target", f"127.0.0.1:{port}")
    conn, _ = await asyncio.to_thread(silent_server.accept)  # the client is waiting now
    with conn:
        interrupted(proc)
