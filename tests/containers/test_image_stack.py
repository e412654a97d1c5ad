"""The built CPU image (`make images`) as a disaggregated stack: Redis, a prefill worker, a
decode worker and a router, each its own container on the host network, with the
security defaults (Redis password, cluster secret, API key, internal mTLS). A gRPC client
outside the containers gets greedy output token-identical to offline vLLM on the host."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.api.client import PdserveClient
from tests.conftest import REFERENCE_MAX_TOKENS
from tests.containers.engine import IMAGE, Engine
from tests.containers.stack import ContainerStack, make_role_certs
from tests.helpers.prompts import TEXT_PROMPTS

pytestmark = [pytest.mark.container, pytest.mark.engine]

# Two engines and the router start on CPUs shared with the offline reference.
START_TIMEOUT_S = 900


async def wait_serving(stack: ContainerStack, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with PdserveClient(stack.target) as client:
        while True:
            for role in ("prefill", "decode", "router"):
                stack.check_running(role)
            try:
                if await client.health("pdserve.v1.GenerationService", timeout=2) == "SERVING":
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the router in its container did not serve within "
                                   f"{timeout:.0f} s:\n{stack.engine.logs(stack.names['router'])}")
            await asyncio.sleep(2)


@pytest.fixture(scope="module")
async def stack(engine: Engine, container_dir: Path,
                offline_reference_proc: object) -> AsyncIterator[ContainerStack]:
    directory = container_dir / "image-stack"
    directory.mkdir()
    stack = ContainerStack(engine, IMAGE, directory)
    # One core per engine where there are two, as `pdserve up` places them.
    cores = {"prefill": "0", "decode": "1"} if (os.cpu_count() or 1) >= 2 else {}
    try:
        stack.start_redis()
        stack.start_pdserve(make_role_certs(directory), cores)
        await wait_serving(stack, START_TIMEOUT_S)
        yield stack
    finally:
        stack.stop()


async def test_greedy_output_matches_offline_vllm(
        stack: ContainerStack, offline_reference: list[dict[str, Any]]) -> None:
    async with PdserveClient(stack.target, api_key=stack.api_key) as client:
        for prompt, ref in zip(TEXT_PROMPTS, offline_reference, strict=True):
            result = await client.generate(text=prompt, temperature=0.0,
                                           max_tokens=REFERENCE_MAX_TOKENS)
            assert result.token_ids == ref["token_ids"], prompt[:40]
            assert result.text == ref["text"]
            assert result.prompt_tokens == len(ref["prompt_token_ids"])
        # Disaggregated: the prompt's KV came from the prefill container.
        chat = await client.generate(chat=[("user", "What is the capital of France?")],
                                     temperature=0.0, max_tokens=32)
    assert "Paris" in chat.text


@pytest.mark.parametrize("key", ["", "pdsk_wrong"])
async def test_router_refuses_without_the_api_key(stack: ContainerStack, key: str) -> None:
    async with PdserveClient(stack.target, api_key=key) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate(text="Hello", max_tokens=2)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_worker_ports_take_mutual_tls_only(stack: ContainerStack) -> None:
    """A plaintext caller (no internal certificate) gets no answer from a worker."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for role in ("prefill", "decode"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports[role]}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, role


def test_containers_run_unprivileged_on_a_read_only_root(stack: ContainerStack) -> None:
    for role in ("prefill", "decode", "router"):
        name = stack.names[role]
        assert stack.engine.cmd("exec", name, "id", "-u").stdout.strip() == "10001"
        denied = stack.engine.cmd("exec", name, "touch", "/opt/pdserve/x", check=False)
        assert denied.returncode != 0 and "Read-only file system" in denied.stderr, role
