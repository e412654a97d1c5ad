"""The one place where an exception raised by a handler becomes a gRPC status: a server
interceptor around every handler of pdserve's servers, unary and streaming alike.

Handlers raise (`services/errors.py`: an `InvalidRequest`, an `Overloaded`, ...), from
anywhere, a streaming handler after some messages too; the call then ends with the
error's status and message, overload with a `retry-after-ms` trailer. Anything that is
not a `PdserveError` is a bug: logged with its traceback, answered INTERNAL.
Cancellation (`asyncio.CancelledError`, not an `Exception`) passes through untouched,
and so does a handler's own `context.abort`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

from services.errors import RETRY_AFTER_KEY, grpc_status, retry_after_ms
from services.server.handlers import behavior, rebuild


async def end_with(context: grpc.aio.ServicerContext, e: Exception) -> NoReturn:
    """End the call with `e`'s status (and a retry hint for overload)."""
    code, message = grpc_status(e)
    hint = retry_after_ms(e)
    if hint is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(hint)),))
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")


def with_statuses(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler`, its exceptions answered with their statuses. Synchronous behaviors are
    left as they are (pdserve's asyncio servers have none)."""
    serve = behavior(handler)
    if inspect.isasyncgenfunction(serve):
        async def stream(request: Any, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[Any]:
            try:
                async with contextlib.aclosing(serve(request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise  # the handler ended the call itself
            except Exception as e:
                await end_with(context, e)

        return rebuild(handler, stream)
    if inspect.iscoroutinefunction(serve):
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await serve(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await end_with(context, e)

        return rebuild(handler, call)
    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Answers every handler's exceptions with their gRPC status (`with_statuses`).
    First among a server's interceptors, so that it also answers the errors the others
    raise (an API key refused)."""

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        return None if handler is None else with_statuses(handler)
