"""The error interceptor on a real grpc.aio server on loopback: an exception a handler
raises, before or after it streamed some messages, ends the call with its status (and
overload with a retry hint); a bug is INTERNAL and logged; a handler's own abort and a
client's cancellation pass through untouched."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from services.errors import RETRY_AFTER_KEY, InvalidRequest, Overloaded
from services.server.listener import interceptors

SERVICE = "pdserve.test.Errors"


class FailingTestServicer:
    """Test code: handlers that stream two messages, then fail as the request says."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def stream(self, request: bytes, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[bytes]:
        for i in range(2):
            yield f"chunk {i}".encode()
        await self.fail(request.decode(), context)
        yield b"done"

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await self.fail(request.decode(), context)
        return b"done"

    async def fail(self, how: str, context: grpc.aio.ServicerContext) -> None:
        if how == "invalid":
            raise InvalidRequest("sampling.top_p: 7 must be in (0, 1]")
        if how == "overloaded":
            raise Overloaded("no capacity", retry_after_ms=250)
        if how == "bug":
            raise KeyError("oops")
        if how == "abort":
            await context.abort(grpc.StatusCode.ABORTED, "ended on purpose")
        if how == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise


@pytest.fixture
async def served() -> AsyncIterator[tuple[FailingTestServicer, grpc.aio.Channel]]:
    servicer = FailingTestServicer()
    server = grpc.aio.server(interceptors=interceptors(None))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Stream": grpc.unary_stream_rpc_method_handler(servicer.stream),
        "Unary": grpc.unary_unary_rpc_method_handler(servicer.unary),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield servicer, channel
    await server.stop(0)


async def stream(channel: grpc.aio.Channel, how: str
                 ) -> tuple[list[bytes], grpc.aio.AioRpcError]:
    """The messages received before the call failed, and how it failed."""
    received: list[bytes] = []
    call = channel.unary_stream(f"/{SERVICE}/Stream")(how.encode(), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for message in call:
            received.append(message)
    return received, e.value


async def test_invalid_request_mid_stream_is_invalid_argument(served) -> None:  # type: ignore[no-untyped-def]
    _, channel = served
    received, error = await stream(channel, "invalid")
    assert received == [b"chunk 0", b"chunk 1"]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "sampling.top_p: 7 must be in (0, 1]"


async def test_unexpected_exception_is_internal_and_logged(
        served, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    _, channel = served
    with caplog.at_level(logging.ERROR, logger="services.errors"):
        received, error = await stream(channel, "bug")
    assert received == [b"chunk 0", b"chunk 1"]
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "KeyError" in error.details()
    assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)


async def test_overload_carries_its_retry_hint(served) -> None:  # type: ignore[no-untyped-def]
    _, channel = served
    _, error = await stream(channel, "overloaded")
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (RETRY_AFTER_KEY, "250") in tuple(error.trailing_metadata() or ())


async def test_unary_handlers_too(served) -> None:  # type: ignore[no-untyped-def]
    _, channel = served
    unary = channel.unary_unary(f"/{SERVICE}/Unary")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await unary(b"invalid", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await unary(b"bug", timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert await unary(b"fine", timeout=10) == b"done"


async def test_a_handlers_own_abort_passes_through(served) -> None:  # type: ignore[no-untyped-def]
    _, channel = served
    received, error = await stream(channel, "abort")
    assert received == [b"chunk 0", b"chunk 1"]
    assert (error.code(), error.details()) == (grpc.StatusCode.ABORTED, "ended on purpose")


async def test_cancellation_reaches_the_handler(
        served, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    servicer, channel = served
    call = channel.unary_stream(f"/{SERVICE}/Stream")(b"hang", timeout=10)
    assert [await call.read(), await call.read()] == [b"chunk 0", b"chunk 1"]
    with caplog.at_level(logging.ERROR, logger="services.errors"):
        call.cancel()
        await asyncio.wait_for(servicer.cancelled.wait(), 5)
        await asyncio.sleep(0.1)
    assert not caplog.records  # not answered as an error: the client is gone
