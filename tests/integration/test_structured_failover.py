"""A constrained answer whose decode worker is SIGKILLed mid-stream: the request moves to
the prefill worker (a full engine), which resumes the constraint after every token the
client already has instead of starting it again, so the answer still obeys it and is
token-identical to colocated."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pdserve.v1 import generate_pb2 as pb
from services.api.client import PdserveClient, build_request
from tests.conftest import start_disagg
from tests.helpers.servers import DisaggStack, ServerProcess
from tests.integration.test_failover_local import listener_pid

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# Long and counted: a constraint started again after the move would count anew.
REGEX = r"([0-9]{3}-){12}[0-9]{3}"
CHAT = [("user", "Write a long serial number.")]
MAX_TOKENS = 80
KILL_AFTER = 6


@pytest.fixture(scope="module")
async def pair(model_path: Path, session_dir: Path) -> AsyncIterator[DisaggStack]:
    async for stack in start_disagg(session_dir, "grpc"):
        yield stack


async def test_constraint_resumes_after_the_move(pair: DisaggStack,
                                                 colocated: ServerProcess) -> None:
    structured = pb.StructuredOutput(regex=REGEX)
    async with PdserveClient(colocated.target) as client:
        want = await client.generate(chat=CHAT, temperature=0.0, max_tokens=MAX_TOKENS,
                                     structured=structured)
    assert want.finish_reason == "stop" and re.fullmatch(REGEX, want.text)
    assert len(want.token_ids) > KILL_AFTER + 4, "the answer must outlast the kill"
    decode_pid = listener_pid(pair.decode_port)
    got: list[int] = []
    text, moved, killed = "", 0, False
    async with PdserveClient(pair.server.target) as client:
        request = build_request(chat=CHAT, temperature=0.0, max_tokens=MAX_TOKENS,
                                structured=structured)
        async for r in client.call(request, timeout=300):
            if r.HasField("chunk"):
                got += r.chunk.token_ids
                text += r.chunk.text
                if len(got) >= KILL_AFTER and not killed:
                    killed = True
                    os.killpg(decode_pid, signal.SIGKILL)
            else:
                moved = r.final.migrations
    assert moved >= 1, "the decode worker was killed after the answer ended"
    assert got == want.token_ids
    assert re.fullmatch(REGEX, text)
