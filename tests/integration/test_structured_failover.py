"""Answers whose decode worker is SIGKILLed mid-stream: the request moves to the prefill
worker (a full engine), which resumes after every token the client already has. A
constrained answer resumes its constraint instead of starting it again, so it still
obeys it; an adapter's answer resumes under the same adapter. Both stay token-identical
to colocated."""

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
from tests.helpers.lora import write_adapter
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


async def stream_and_kill(target: str, decode_port: int, request: pb.GenerateRequest
                          ) -> tuple[list[int], str, int]:
    """Stream `request`, SIGKILL the decode worker once KILL_AFTER tokens arrived:
    (tokens received, text received, migrations)."""
    decode_pid = listener_pid(decode_port)
    got: list[int] = []
    text, moved, killed = "", 0, False
    async with PdserveClient(target) as client:
        async for r in client.call(request, timeout=300):
            if r.HasField("chunk"):
                got += r.chunk.token_ids
                text += r.chunk.text
                if len(got) >= KILL_AFTER and not killed:
                    killed = True
                    os.killpg(decode_pid, signal.SIGKILL)
            else:
                moved = r.final.migrations
    return got, text, moved


async def test_constraint_resumes_after_the_move(pair: DisaggStack,
                                                 colocated: ServerProcess) -> None:
    structured = pb.StructuredOutput(regex=REGEX)
    async with PdserveClient(colocated.target) as client:
        want = await client.generate(chat=CHAT, temperature=0.0, max_tokens=MAX_TOKENS,
                                     structured=structured)
    assert want.finish_reason == "stop" and re.fullmatch(REGEX, want.text)
    assert len(want.token_ids) > KILL_AFTER + 4, "the answer must outlast the kill"
    got, text, moved = await stream_and_kill(
        pair.server.target, pair.decode_port,
        build_request(chat=CHAT, temperature=0.0, max_tokens=MAX_TOKENS, structured=structured))
    assert moved >= 1, "the decode worker was killed after the answer ended"
    assert got == want.token_ids
    assert re.fullmatch(REGEX, text)


@pytest.fixture(scope="module")
def adapter(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("adapters") / "sql", model_path, seed=0)


async def test_adapter_answer_resumes_under_its_adapter(adapter: Path, session_dir: Path
                                                        ) -> None:
    """The prefill worker that takes the request over runs it under the same adapter:
    under the base model the continuation would differ from colocated's."""
    lora = ("--lora", f"sql={adapter}", "--max-loras", "2")
    chat = [("user", "Write a long story about a lighthouse keeper.")]
    request = build_request(chat=chat, model="sql", temperature=0.0, max_tokens=40,
                            ignore_eos=True)
    colocated = ServerProcess(["--mode", "colocated", "--kv-cache-gib", "1", *lora],
                              session_dir / "failover-colocated-lora.log")
    async with colocated.running(), PdserveClient(colocated.target) as client:
        want = await client.generate(chat=chat, model="sql", temperature=0.0, max_tokens=40,
                                     ignore_eos=True)
        base = await client.generate(chat=chat, temperature=0.0, max_tokens=40,
                                     ignore_eos=True)
    assert want.token_ids != base.token_ids, "the adapter must change the answer"
    stack = DisaggStack.create(session_dir / "failover-disagg-lora.log", "grpc", *lora)
    async with stack.server.running(timeout=600):
        got, _, moved = await stream_and_kill(stack.server.target, stack.decode_port, request)
        assert moved >= 1, "the decode worker was killed after the answer ended"
        assert got == want.token_ids
