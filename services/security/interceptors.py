"""The public gRPC API's authentication: a server interceptor that lets a call through
only with a known API key (`authorization: Bearer <key>` metadata) and tells the
servicer which client the key names.

`grpc.health.v1.Health` stays open (load balancers and Kubernetes probes carry no key);
everything else, server reflection included, needs a key: reflection lists the API,
so it is as open as the API is.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from services.errors import PdserveError, grpc_status
from services.security.apikeys import CURRENT_CLIENT, ApiKeys, bearer_from_metadata

HEALTH_SERVICE = "grpc.health.v1.Health"
OPEN_SERVICES = (HEALTH_SERVICE,)

def _service_of(method: str) -> str:
    # "/pdserve.v1.GenerationService/Generate" -> "pdserve.v1.GenerationService"
    return method.lstrip("/").split("/", 1)[0]


_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _kind(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"


def _rebuild(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]
             ) -> grpc.RpcMethodHandler:
    return _FACTORIES[_kind(handler)](behavior,
                                      request_deserializer=handler.request_deserializer,
                                      response_serializer=handler.response_serializer)


def _refusing(handler: grpc.RpcMethodHandler, error: PdserveError) -> grpc.RpcMethodHandler:
    code, message = grpc_status(error)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return _rebuild(handler, refuse)


def _as_client(handler: grpc.RpcMethodHandler, client: str) -> grpc.RpcMethodHandler:
    behavior = getattr(handler, _kind(handler))
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[Any]:
            CURRENT_CLIENT.set(client)  # this call's task only: each call runs in its own
            async for item in behavior(request, context):
                yield item

        return _rebuild(handler, stream)

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        CURRENT_CLIENT.set(client)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return _rebuild(handler, call)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid API key with UNAUTHENTICATED (through
    `services.errors.Unauthenticated`), except to `open_services`."""

    def __init__(self, keys: ApiKeys, open_services: Iterable[str] = OPEN_SERVICES) -> None:
        self.keys = keys
        self.open_services = frozenset(open_services)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or _service_of(details.method) in self.open_services:
            return handler
        try:
            client = self.keys.authenticate(bearer_from_metadata(details.invocation_metadata))
        except PdserveError as e:
            return _refusing(handler, e)
        return _as_client(handler, client)
