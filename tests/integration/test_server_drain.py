"""A server's drain on a real gRPC port on loopback: while a stream finishes, the port
stays open, health checks are answered (NOT_SERVING) and new calls are refused with
UNAVAILABLE; a stream that outlasts the grace period is cut when it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.server.grpc_server import Bound, Service, serve
from services.server.listener import Listener
from services.server.settings import ServerSettings

SERVICE = "pdserve.test.Ticks"
TICK_S = 0.2


def ticks_service() -> Service:
    """A plain byte stream: `n` ticks, one every TICK_S (the request is n, one byte)."""

    async def ticks(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for i in range(request[0]):
            await asyncio.sleep(TICK_S)
            yield bytes([i])

    def register(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"Ticks": grpc.unary_stream_rpc_method_handler(ticks)}),))

    return Service(SERVICE, register)


class Running:
    def __init__(self, grace_s: float) -> None:
        self.stop = asyncio.Event()
        self.bound: asyncio.Future[Bound] = asyncio.get_running_loop().create_future()
        settings = ServerSettings(port=0, metrics_port=0, grace_s=grace_s)
        self.task = asyncio.create_task(serve(
            settings, [ticks_service()], "test server", Listener(None, None, False),
            on_ready=self.bound.set_result, stop=self.stop))

    async def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"127.0.0.1:{(await self.bound).port}")


def ticks(channel: grpc.aio.Channel, n: int) -> Any:
    return channel.unary_stream(f"/{SERVICE}/Ticks")(bytes([n]))


async def health(channel: grpc.aio.Channel) -> int:
    answer = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=2)
    return int(answer.status)


async def test_a_draining_server_answers_health_refuses_new_calls_and_finishes_streams(
        ) -> None:
    server = Running(grace_s=30)
    async with await server.channel() as channel:
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
        stream = ticks(channel, 15)
        got = [await stream.read()]  # the call is in flight
        server.stop.set()
        await asyncio.sleep(TICK_S)
        # Draining: a liveness probe still gets an answer, as the router's watchdog needs.
        assert await health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ticks(channel, 1).read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in str(refused.value.details())
        while (tick := await stream.read()) is not grpc.aio.EOF:
            got.append(tick)
        assert got == [bytes([i]) for i in range(15)]  # finished whole, not cut
        assert await stream.code() == grpc.StatusCode.OK
    await asyncio.wait_for(server.task, 10)  # and the server ended once it had


async def test_a_stream_longer_than_the_grace_period_is_cut_at_its_end() -> None:
    server = Running(grace_s=0.5)
    async with await server.channel() as channel:
        stream = ticks(channel, 100)
        await stream.read()
        server.stop.set()
        got = 1
        with pytest.raises(grpc.aio.AioRpcError):
            while await stream.read() is not grpc.aio.EOF:
                got += 1
        assert got < 100
    await asyncio.wait_for(server.task, 10)
