"""deploy/compose.yaml as it ships, brought up with the engine's compose tool (podman-compose
or `docker compose`) on the built image, Redis included (REDIS_IMAGE: the same image, since
no other may be reachable): the router answers over gRPC and OpenAI HTTP with its API key,
and refuses without it."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.api.client import PdserveClient
from services.server.channels import free_port
from tests.containers.conftest import unavailable
from tests.containers.engine import IMAGE, Engine

pytestmark = [pytest.mark.container, pytest.mark.engine]

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "deploy" / "compose.yaml"
START_TIMEOUT_S = 900


@dataclass
class Compose:
    argv: list[str]
    env: dict[str, str]
    api_key: str
    ports: dict[str, int]

    def __call__(self, *args: str, timeout: float = 600,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([*self.argv, *args], env=self.env, capture_output=True,
                             text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}):\n"
                               f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out


def compose_tool(engine: Engine, project: str) -> list[str]:
    if engine.name == "docker":
        return ["docker", "compose", "-p", project, "-f", str(COMPOSE_FILE)]
    if shutil.which("podman-compose") is None:
        unavailable("podman-compose is not installed (Debian: apt-get install podman-compose)")
    argv = ["podman-compose", "-p", project, "-f", str(COMPOSE_FILE)]
    if engine.argv[1:]:  # e.g. --runtime runc
        argv += ["--podman-args", " ".join(engine.argv[1:])]
    return argv


async def wait_serving(compose: Compose, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with PdserveClient(f"127.0.0.1:{compose.ports['grpc']}") as client:
        while True:
            try:
                if await client.health("pdserve.v1.GenerationService", timeout=2) == "SERVING":
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                logs = compose("logs", "--tail", "60", check=False)
                raise TimeoutError(f"the compose stack did not serve within {timeout:.0f} s:\n"
                                   f"{logs.stdout[-6000:]}{logs.stderr[-2000:]}")
            await asyncio.sleep(3)


@pytest.fixture(scope="module")
async def compose(engine: Engine, container_dir: Path) -> AsyncIterator[Compose]:
    project = f"pdserve-test-{uuid.uuid4().hex[:8]}"
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    api_key = secrets.token_hex(32)
    env = {
        **os.environ, **engine.env,
        "PDSERVE_IMAGE": IMAGE, "REDIS_IMAGE": IMAGE,
        "PDSERVE_REDIS_PASSWORD": secrets.token_hex(32),
        "PDSERVE_CLUSTER_SECRET": secrets.token_hex(32),
        "PDSERVE_API_KEY": api_key,
        "ROUTER_GRPC_PORT": str(ports["grpc"]), "ROUTER_HTTP_PORT": str(ports["http"]),
        "ROUTER_METRICS_PORT": str(ports["metrics"]),
    }
    stack = Compose(compose_tool(engine, project), env, api_key, ports)
    try:
        # No build: the image is `make images`'s (compose's build section is for docker).
        stack("up", "-d", "--no-build")
        await wait_serving(stack, START_TIMEOUT_S)
        yield stack
    finally:
        logs = stack("logs", check=False)
        (container_dir / f"{project}.log").write_text(logs.stdout + logs.stderr)
        stack("down", "-t", "20", check=False)


async def test_router_answers_with_its_api_key(compose: Compose) -> None:
    async with PdserveClient(f"127.0.0.1:{compose.ports['grpc']}",
                             api_key=compose.api_key) as client:
        result = await client.generate(chat=[("user", "What is the capital of France?")],
                                       temperature=0.0, max_tokens=32)
    assert "Paris" in result.text
    assert result.finish_reason == "stop"


async def test_router_refuses_without_the_api_key(compose: Compose) -> None:
    async with PdserveClient(f"127.0.0.1:{compose.ports['grpc']}") as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate(text="Hello", max_tokens=2)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_openai_http_with_the_api_key(compose: Compose) -> None:
    url = f"http://127.0.0.1:{compose.ports['http']}/v1/models"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=30)
    assert refused.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {compose.api_key}"})
    models = json.loads(urllib.request.urlopen(request, timeout=30).read())
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct-float32"]
