"""A drain that keeps the port open: the calls a server is handling finish while it
still answers health checks, and new calls are refused.

grpc's own `server.stop(grace)` refuses every new call at once, health checks among them.
The router probes a worker whose stream has gone quiet (`services/router/watchdog.py`)
and takes one that does not answer for hung, so a draining worker whose stream paused
for a moment (its core busy) would lose that stream to a migration it did not need. Here
the drain waits for the calls in flight with the port open, answering health (NOT_SERVING
by then) and refusing other new calls with UNAVAILABLE, as `stop` would; `stop` follows.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.errors import Unavailable
from services.server.handlers import behavior, rebuild

HEALTH = "/grpc.health.v1.Health/"


class InFlight(grpc.aio.ServerInterceptor):
    """Counts the calls being handled (health checks aside); after `drain()` starts,
    refuses new ones. Last among a server's interceptors, so it counts only calls the
    others let through."""

    def __init__(self) -> None:
        self.calls = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH):
            return handler
        if self.draining:
            return refusing(handler)
        return self._counted(handler)

    def _enter(self) -> None:
        self.calls += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.calls -= 1
        if not self.calls:
            self._idle.set()

    def _counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        serve = behavior(handler)
        if inspect.isasyncgenfunction(serve):
            async def stream(request: Any, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[Any]:
                self._enter()
                try:
                    async for item in serve(request, context):
                        yield item
                finally:
                    self._leave()

            return rebuild(handler, stream)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self._enter()
            try:
                result = serve(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                self._leave()

        return rebuild(handler, call)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new calls and wait up to `timeout_s` for those in flight to end;
        whether they all did."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


def refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        raise Unavailable("the server is shutting down; retry the call on another replica")

    return rebuild(handler, refuse)
