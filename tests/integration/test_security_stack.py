"""A secured `pdserve serve --mode disagg` (real vLLM engines, one stack for the module):
API keys and TLS on the public gRPC and HTTP ports, mutual TLS on the worker ports and
the KV transport, a plaintext health-only port, loopback binds.

Per port: without credentials refused, with a certificate from another CA refused, with
the right ones served. Also: an open bind is refused before any engine starts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.api.client import PdserveClient
from services.security import certs
from services.security.tls import TLSFiles
from services.server.channels import dial
from tests.helpers.servers import DisaggStack, free_port

pytestmark = [pytest.mark.engine, pytest.mark.slow]

KEY = "alice-key-0123456789abcdef"
PROMPT = "The capital of France is"


class Secured:
    def __init__(self, root: Path, other: Path, stack: DisaggStack, health_port: int) -> None:
        self.root, self.other, self.stack, self.health_port = root, other, stack, health_port
        self.public_ca = certs.public_files(root, "server").ca
        self.internal = certs.internal_files(root, "router")

    @property
    def target(self) -> str:
        return self.stack.server.target

    def client(self, api_key: str = KEY, ca: Path | None = None) -> PdserveClient:
        return PdserveClient(self.target, api_key=api_key,
                             tls=TLSFiles(ca=ca or self.public_ca))


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    root, other = tmp_path_factory.mktemp("certs"), tmp_path_factory.mktemp("other")
    certs.init(root)
    certs.init(other)
    keys = root / "api-keys"
    keys.write_text(f"alice:{KEY}\n")
    server, internal = certs.public_files(root, "server"), certs.internal_files(root, "router")
    stack = DisaggStack.create(tmp_path_factory.mktemp("logs") / "secured.log", "grpc")
    health_port = free_port()
    stack.server.args += [
        "--api-keys-file", str(keys), "--health-port", str(health_port),
        "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
        "--internal-tls-ca-file", str(internal.ca),
        "--internal-tls-cert-file", str(internal.cert),
        "--internal-tls-key-file", str(internal.key),
    ]
    stack.server.start()
    secured = Secured(root, other, stack, health_port)
    try:
        asyncio.run(_wait_ready(secured))
        yield secured
    finally:
        stack.server.stop()


async def _wait_ready(s: Secured, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    # The plaintext health-only port: what a probe without credentials can ask.
    async with PdserveClient(f"127.0.0.1:{s.health_port}") as probe:
        while True:
            proc = s.stack.server.proc
            assert proc is not None
            if proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{s.stack.server.log_tail(80)}")
            try:
                if await probe.health("pdserve.v1.GenerationService", timeout=1.0) == "SERVING":
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(s.stack.server.log_tail())
            await asyncio.sleep(0.5)


async def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value.code()


# -- public gRPC -------------------------------------------------------------------------
async def test_public_grpc(secured: Secured) -> None:
    async with secured.client(api_key="") as anonymous:
        assert await code_of(anonymous.generate(text=PROMPT, max_tokens=4)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert await anonymous.health() == "SERVING"  # health stays open
    async with secured.client(api_key="wrong-key-0123456789abcdef") as wrong:
        assert await code_of(wrong.model_info()) == grpc.StatusCode.UNAUTHENTICATED
    other_ca = certs.public_files(secured.other, "server").ca
    async with secured.client(ca=other_ca) as impostor_side:
        assert await code_of(impostor_side.generate(text=PROMPT, max_tokens=4)) == \
            grpc.StatusCode.UNAVAILABLE
    async with PdserveClient(secured.target, api_key=KEY) as plaintext:
        assert await code_of(plaintext.generate(text=PROMPT, max_tokens=4)) == \
            grpc.StatusCode.UNAVAILABLE
    async with secured.client() as client:
        result = await client.generate(text=PROMPT, max_tokens=8, temperature=0)
        assert result.completion_tokens == 8 and result.text


async def test_public_reflection_follows_the_api(secured: Secured) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def services(client: PdserveClient) -> list[str]:
        stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        names = []
        async for reply in stub.ServerReflectionInfo(iter([request]), timeout=10,
                                                     metadata=client.metadata):
            names += [s.name for s in reply.list_services_response.service]
        return names

    async with secured.client() as client:
        assert "pdserve.v1.GenerationService" in await services(client)
    async with secured.client(api_key="") as anonymous:
        # The server refuses on the headers, before any message. Opened without a request
        # iterator so the client writes nothing: an asyncio client's write that races the
        # server's early status replaces that status with INTERNAL (grpc/grpc#36066).
        stub = reflection_pb2_grpc.ServerReflectionStub(anonymous.channel)
        call = stub.ServerReflectionInfo(timeout=10, metadata=anonymous.metadata)
        assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in await call.details()


# -- HTTP --------------------------------------------------------------------------------
async def test_http(secured: Secured) -> None:
    import httpx
    import openai

    base = f"https://127.0.0.1:{secured.stack.server.http_port}"
    async with httpx.AsyncClient(base_url=base, verify=str(secured.public_ca)) as http:
        assert (await http.get("/health")).status_code == 200
        refused = await http.get("/v1/models")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == 401
        ok = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
    with pytest.raises(httpx.ConnectError):  # a client trusting another CA
        async with httpx.AsyncClient(verify=str(certs.public_files(
                secured.other, "server").ca)) as other:
            await other.get(f"{base}/health")
    async with httpx.AsyncClient(verify=str(secured.public_ca)) as transport:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, http_client=transport,
                                    max_retries=0)
        answer = await client.completions.create(model="", prompt=PROMPT, max_tokens=4,
                                                 temperature=0)
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        bad = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="nope-nope-nope-nope",
                                 http_client=transport, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()


# -- worker gRPC (internal mTLS) ---------------------------------------------------------
@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_worker_ports(secured: Secured, role: str) -> None:
    from pdserve.v1 import worker_pb2 as wpb
    from pdserve.v1 import worker_pb2_grpc as wpb_grpc

    target = getattr(secured.stack, f"{role}_target")
    stub_of = (wpb_grpc.PrefillServiceStub if role == "prefill"
               else wpb_grpc.DecodeServiceStub)
    request = wpb.GetWorkerInfoRequest()

    async def info(channel: grpc.aio.Channel) -> Any:
        async with channel:
            return await stub_of(channel).GetWorkerInfo(request, timeout=10)

    assert await code_of(info(grpc.aio.insecure_channel(target))) == \
        grpc.StatusCode.UNAVAILABLE
    foreign = certs.internal_files(secured.other, "router")
    assert await code_of(info(dial(target, TLSFiles(
        secured.internal.ca, foreign.cert, foreign.key)))) == \
        grpc.StatusCode.UNAVAILABLE
    # A public-API client certificate of the same set is no internal peer either.
    client_cert = certs.public_files(secured.root, "client")
    assert await code_of(info(dial(target, TLSFiles(
        secured.internal.ca, client_cert.cert, client_cert.key)))) == \
        grpc.StatusCode.UNAVAILABLE
    reply = await info(dial(target, secured.internal))
    assert reply.worker_id
    # No reflection on worker ports (not asked for).
    from grpc_reflection.v1alpha import reflection_pb2_grpc

    async with dial(target, secured.internal) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        # Opened without writing (see test_public_reflection_follows_the_api).
        call = stub.ServerReflectionInfo(timeout=10)
        assert await call.code() == grpc.StatusCode.UNIMPLEMENTED


# -- binds -------------------------------------------------------------------------------
def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1, a dual-stack socket bound to 127.0.0.1
    return ip.is_loopback


def test_every_listener_is_on_loopback(secured: Secured) -> None:
    """pdserve's ports, and those of the vLLM processes it started, in the whole
    process tree of the stack."""
    import psutil

    proc = secured.stack.server.proc
    assert proc is not None
    root = psutil.Process(proc.pid)
    found = []
    for p in [root, *root.children(recursive=True)]:
        try:
            connections = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(p.pid, " ".join(p.cmdline()[:4]), c.laddr) for c in connections
                  if c.status == psutil.CONN_LISTEN]
    assert found
    assert not [f for f in found if not _loopback(f[2].ip)], found


def test_an_open_bind_is_refused_before_the_engine_starts() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--mode", "colocated",
         "--host", "0.0.0.0", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "neither API keys nor TLS" in result.stderr and "--allow-insecure" in result.stderr
    assert "Engine" not in result.stderr  # refused before vLLM was asked for anything
