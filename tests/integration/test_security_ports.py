"""Per-channel refusals with real gRPC servers and a real uvicorn on loopback, no engine:

- an internal (mTLS) port: served to a peer with an internal certificate; refused to a
  peer without a certificate, with one from another CA, with a public-API client
  certificate, or in plaintext; the client refuses a server from another CA; the same
  for a worker's KV events stream (WatchKVEvents);
- the public TLS port, with and without required client certificates;
- API keys on gRPC (health open, reflection and the API closed) and on HTTP (401 in
  OpenAI's error shape, as the `openai` client sees it).

The servers carry grpc.health.v1 and server reflection (what every pdserve port serves)
and, for the key tests, a small test service that answers with the authenticated client
name, to show what the servicer behind the interceptor is told.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvicorn
from fastapi import FastAPI, Request
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from services.security import certs
from services.security.apikeys import ApiKeys, authenticated_client
from services.security.http_auth import ApiKeyMiddleware
from services.security.policy import PublicAuth
from services.security.tls import INTERNAL_CHANNEL_OPTIONS, TLSFiles, channel_credentials
from services.server.channels import dial, grpc_options
from services.server.listener import interceptors
from services.server.ports import add_internal_port, add_public_port

ALICE = "alice-key-0123456789abcdef"


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Ours, and a second, unrelated set (another CA)."""
    ours, theirs = tmp_path_factory.mktemp("ours"), tmp_path_factory.mktemp("theirs")
    certs.init(ours)
    certs.init(theirs)
    return ours, theirs


WHOAMI = "/pdserve.test.WhoAmI/"


def _whoami_handler() -> grpc.GenericRpcHandler:
    """A test service: `Unary` and `Stream` answer with the client the key names."""
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return (authenticated_client() or "").encode()

    async def stream(request: bytes, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[bytes]:
        for _ in range(2):
            await asyncio.sleep(0)
            yield (authenticated_client() or "").encode()

    return grpc.method_handlers_generic_handler("pdserve.test.WhoAmI", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    })


@contextlib.asynccontextmanager
async def grpc_server(bind: Any, interceptors: list[Any] | None = None
                      ) -> AsyncIterator[int]:
    """A server with health, reflection and WhoAmI on a loopback port bound by
    `bind(server, address)`."""
    server = grpc.aio.server(interceptors=interceptors or [], options=grpc_options())
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection((health.SERVICE_NAME, reflection.SERVICE_NAME),
                                        server)
    server.add_generic_rpc_handlers((_whoami_handler(),))
    port = bind(server, "127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


async def health_check(channel: grpc.aio.Channel, **kwargs: Any) -> Any:
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return await stub.Check(health_pb2.HealthCheckRequest(), timeout=5, **kwargs)


async def refused(channel: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await health_check(channel)
    return e.value.code()


def tls_channel(port: int, files: TLSFiles, internal: bool = True) -> grpc.aio.Channel:
    options = list(INTERNAL_CHANNEL_OPTIONS) if internal else []
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", channel_credentials(files),
                                   options=options)


# -- internal ports: mutual TLS ----------------------------------------------------------
async def test_internal_port_serves_only_internal_peers(sets: tuple[Path, Path]) -> None:
    ours, theirs = sets
    decode = certs.internal_files(ours, "decode")
    router = certs.internal_files(ours, "router")
    async with grpc_server(lambda s, a: add_internal_port(s, a, decode)) as port:
        address = f"127.0.0.1:{port}"
        ok = await health_check(dial(address, router))
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        # No certificate at all (trusting our CA).
        assert await refused(tls_channel(port, TLSFiles(ca=router.ca))) == \
            grpc.StatusCode.UNAVAILABLE
        # A certificate from another CA, offered by a client that trusts ours.
        foreign = certs.internal_files(theirs, "router")
        assert await refused(tls_channel(port, TLSFiles(router.ca, foreign.cert,
                                                        foreign.key))) == \
            grpc.StatusCode.UNAVAILABLE
        # A public-API client certificate of the same `certs init` set.
        client = certs.public_files(ours, "client")
        assert await refused(tls_channel(port, TLSFiles(router.ca, client.cert,
                                                        client.key))) == \
            grpc.StatusCode.UNAVAILABLE
        # Plaintext.
        assert await refused(grpc.aio.insecure_channel(address)) == \
            grpc.StatusCode.UNAVAILABLE
        # The client side: a router of the other set does not accept our server.
        assert await refused(dial(address, foreign)) == \
            grpc.StatusCode.UNAVAILABLE


async def test_internal_clients_check_the_internal_name(sets: tuple[Path, Path]) -> None:
    """The public server certificate (same machine, another CA and name) is no internal
    server, and the internal name is what is checked, not the address dialled."""
    ours, _ = sets
    server = certs.public_files(ours, "server")
    router = certs.internal_files(ours, "router")
    public = PublicAuth(None, TLSFiles(None, server.cert, server.key))
    async with grpc_server(lambda s, a: add_public_port(s, a, public)) as port:
        assert await refused(dial(f"127.0.0.1:{port}", router)) \
            == grpc.StatusCode.UNAVAILABLE
    decode = certs.internal_files(ours, "decode")
    async with grpc_server(lambda s, a: add_internal_port(s, a, decode)) as port:
        # Without the name override, the client checks "127.0.0.1": not in the cert.
        assert await refused(tls_channel(port, router, internal=False)) == \
            grpc.StatusCode.UNAVAILABLE


async def test_kv_events_are_served_only_to_internal_peers(sets: tuple[Path, Path]) -> None:
    """WatchKVEvents (cached token ids) rides a worker's internal port: a router with an
    internal certificate subscribes; no stream opens for anyone else."""
    from pdserve.v1 import worker_pb2 as wpb
    from services.router.orchestrator import Peer
    from services.worker.kv_events import EventRelay
    from tests.helpers.kv_events import events_server

    ours, theirs = sets
    decode = certs.internal_files(ours, "decode")
    router = certs.internal_files(ours, "router")
    relay = EventRelay()
    try:
        async with events_server(relay, bind=lambda s, a: add_internal_port(s, a, decode)
                                 ) as port:
            address = f"127.0.0.1:{port}"

            async def watch_code(channel: grpc.aio.Channel) -> grpc.StatusCode:
                async with channel:
                    call = Peer("w", channel).watch_kv_events(wpb.WatchKVEventsRequest(),
                                                              timeout=5)
                    return await call.code()

            foreign = certs.internal_files(theirs, "router")
            client = certs.public_files(ours, "client")
            for channel in (grpc.aio.insecure_channel(address),
                            tls_channel(port, TLSFiles(ca=router.ca)),
                            tls_channel(port, TLSFiles(router.ca, foreign.cert, foreign.key)),
                            tls_channel(port, TLSFiles(router.ca, client.cert, client.key))):
                assert await watch_code(channel) == grpc.StatusCode.UNAVAILABLE
                assert relay.subscribers == 0
            async with dial(address, router) as channel:
                call = Peer("w", channel).watch_kv_events(wpb.WatchKVEventsRequest())
                deadline = asyncio.get_running_loop().time() + 10
                while relay.subscribers != 1:
                    assert asyncio.get_running_loop().time() < deadline, "not subscribed"
                    await asyncio.sleep(0.05)
                call.cancel()
    finally:
        relay.close()


# -- the public port: TLS, optionally mutual ----------------------------------------------
async def test_public_tls_port(sets: tuple[Path, Path]) -> None:
    ours, theirs = sets
    server = certs.public_files(ours, "server")
    auth = PublicAuth(None, TLSFiles(None, server.cert, server.key))
    async with grpc_server(lambda s, a: add_public_port(s, a, auth)) as port:
        ok = await health_check(tls_channel(port, TLSFiles(ca=server.ca), internal=False))
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        # A client that trusts another CA refuses the server; plaintext gets nowhere.
        other = certs.public_files(theirs, "server")
        assert await refused(tls_channel(port, TLSFiles(ca=other.ca), internal=False)) == \
            grpc.StatusCode.UNAVAILABLE
        assert await refused(grpc.aio.insecure_channel(f"127.0.0.1:{port}")) == \
            grpc.StatusCode.UNAVAILABLE


async def test_public_port_with_client_certificates(sets: tuple[Path, Path]) -> None:
    ours, theirs = sets
    server = certs.public_files(ours, "server")  # ca = the public CA: client certs required
    auth = PublicAuth(None, server)
    assert auth.requires_client_cert and auth.authenticated
    client = certs.public_files(ours, "client")
    async with grpc_server(lambda s, a: add_public_port(s, a, auth)) as port:
        ok = await health_check(tls_channel(port, client, internal=False))
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        assert await refused(tls_channel(port, TLSFiles(ca=client.ca), internal=False)) == \
            grpc.StatusCode.UNAVAILABLE
        stranger = certs.public_files(theirs, "client")
        assert await refused(tls_channel(port, TLSFiles(client.ca, stranger.cert,
                                                        stranger.key), internal=False)) == \
            grpc.StatusCode.UNAVAILABLE
        # An internal certificate is not a public client's.
        router = certs.internal_files(ours, "router")
        assert await refused(tls_channel(port, TLSFiles(client.ca, router.cert, router.key),
                                         internal=False)) == grpc.StatusCode.UNAVAILABLE


# -- API keys on gRPC --------------------------------------------------------------------
async def reflect(channel: grpc.aio.Channel, **kwargs: Any) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    names = []
    async for reply in stub.ServerReflectionInfo(iter([request]), timeout=5, **kwargs):
        names += [s.name for s in reply.list_services_response.service]
    return names


async def test_api_keys_on_grpc() -> None:
    keys = ApiKeys.load(None, env={"PDSERVE_API_KEYS": f"alice:{ALICE}"})
    assert keys is not None
    auth = PublicAuth(keys, None)
    async with grpc_server(lambda s, a: add_public_port(s, a, auth),
                           interceptors(auth)) as port:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        async with channel:
            # Health stays open.
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            unary = channel.unary_unary(WHOAMI + "Unary")
            stream = channel.unary_stream(WHOAMI + "Stream")
            good = (("authorization", f"Bearer {ALICE}"),)
            for metadata, message in ((None, "missing API key"),
                                      ((("authorization", "Bearer nope-nope-nope-nope"),),
                                       "invalid API key"),
                                      ((("authorization", f"Basic {ALICE}"),),
                                       "missing API key")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await unary(b"", metadata=metadata, timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert message in (e.value.details() or "")
                # Reflection is refused on the headers too. Opened without writing: an
                # asyncio client's write racing the server's early status replaces that
                # status with INTERNAL (grpc/grpc#36066).
                refused = reflection_pb2_grpc.ServerReflectionStub(channel) \
                    .ServerReflectionInfo(metadata=metadata, timeout=5)
                assert await refused.code() == grpc.StatusCode.UNAUTHENTICATED
                assert message in (await refused.details() or "")
            # With the key: served, and the servicer knows the client by the key.
            assert await unary(b"", metadata=good, timeout=5) == b"alice"
            assert [r async for r in stream(b"", metadata=good, timeout=5)] == [b"alice"] * 2
            assert health.SERVICE_NAME in await reflect(channel, metadata=good)
            # A call without a key after one with it: nothing carries over.
            with pytest.raises(grpc.aio.AioRpcError):
                await unary(b"", timeout=5)


# -- API keys on HTTP ----------------------------------------------------------------------
@contextlib.asynccontextmanager
async def http_app(keys: ApiKeys) -> AsyncIterator[int]:
    app = FastAPI()

    @app.get("/health")
    async def healthz() -> dict[str, str]:
        return {}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [], "client": request.state.client,
                "context": authenticated_client()}

    app.add_middleware(ApiKeyMiddleware, keys=keys)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def test_api_keys_on_http() -> None:
    import httpx
    import openai

    keys = ApiKeys.load(None, env={"PDSERVE_API_KEYS": f"alice:{ALICE}"})
    assert keys is not None
    async with http_app(keys) as port, httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}") as http:
        assert (await http.get("/health")).status_code == 200
        refused = await http.get("/v1/models")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Bearer")
        body = refused.json()["error"]
        assert body["code"] == 401 and "missing API key" in body["message"]
        wrong = await http.get("/v1/models", headers={"Authorization": "Bearer x" * 3})
        assert wrong.status_code == 401 and wrong.json()["error"]["message"] == (
            "invalid API key")
        ok = await http.get("/v1/models", headers={"Authorization": f"Bearer {ALICE}"})
        assert ok.status_code == 200
        assert ok.json()["client"] == ok.json()["context"] == "alice"
        # What users of the openai client see.
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                    api_key="not-a-key-0123456789", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            await client.models.list()
        assert "invalid API key" in str(e.value)
        good = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=ALICE,
                                  max_retries=0)
        assert (await good.models.list()).data == []
