"""`pdserve serve --mode disagg` when its decode worker dies mid-answer: every stream
moves to the prefill worker (a full engine) and ends token-identical to colocated; new
requests keep being served. Its own pair per KV transport (the test kills a worker): the
default, and nixl with shared memory off, so that its KV really goes over NIXL."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from services.api.client import PdserveClient
from tests.conftest import start_disagg
from tests.helpers.prompts import prompt_of_length
from tests.helpers.servers import DisaggStack, ServerProcess
from tests.helpers.streams import reference, streams_through

pytestmark = pytest.mark.engine


TRANSPORTS = {"grpc": (), "nixl": ("--no-kv-shm",)}


@pytest.fixture(scope="module", params=list(TRANSPORTS))
async def pair(request: pytest.FixtureRequest, model_path: Path,
               session_dir: Path) -> AsyncIterator[DisaggStack]:
    async for stack in start_disagg(session_dir, request.param, *TRANSPORTS[request.param]):
        yield stack


def listener_pid(port: int) -> int:
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            assert conn.pid is not None
            return conn.pid
    raise AssertionError(f"nothing listens on port {port}")


async def test_decode_worker_killed_mid_stream(pair: DisaggStack, colocated: ServerProcess,
                                               tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = [prompt_of_length(tokenizer, n, salt=f"local crash {n}") for n in (50, 400)]
    expected = await reference(colocated, prompts, 40)
    decode_pid = listener_pid(pair.decode_port)
    # the worker runs in its own session: its process group is the worker and its engine
    results = await streams_through(pair.server, prompts, 40,
                                    lambda: os.killpg(decode_pid, signal.SIGKILL))
    for (tokens, moved), want in zip(results, expected, strict=True):
        assert tokens == want
        assert moved >= 1
    started = time.monotonic()
    async with PdserveClient(pair.server.target) as client:
        r = await client.generate(token_ids=prompt_of_length(tokenizer, 30, salt="after"),
                                  temperature=0.0, max_tokens=4, ignore_eos=True)
    assert r.completion_tokens == 4 and time.monotonic() - started < 5
    if "nixl" in pair.server.args:  # NIXL carried the KV: its agent came up, and no
        log = pair.server.log_path.read_text(errors="replace")  # transfer went to gRPC
        assert "Initialized NIXL agent" in log and "not NIXL" not in log
