"""The public gRPC API's authentication: a server interceptor that lets a call through
only with a known API key (`authorization: Bearer <key>` metadata) and tells the
servicer which client the key names (`services/security/apikeys.py` decides who may
connect; this module applies it to calls).

`grpc.health.v1.Health` stays open (load balancers and Kubernetes probes carry no key);
everything else, server reflection included, needs a key: reflection lists the API,
so it is as open as the API is. A refusal is raised as `Unauthenticated`, answered by
the `ErrorInterceptor` that comes before this one.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from services.errors import PdserveError
from services.security.apikeys import CURRENT_CLIENT, ApiKeys, bearer_from_metadata
from services.server.handlers import behavior, rebuild

HEALTH_SERVICE = "grpc.health.v1.Health"
OPEN_SERVICES = (HEALTH_SERVICE,)


def _service_of(method: str) -> str:
    # "/pdserve.v1.GenerationService/Generate" -> "pdserve.v1.GenerationService"
    return method.lstrip("/").split("/", 1)[0]


def _refusing(handler: grpc.RpcMethodHandler, error: PdserveError) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        raise error

    return rebuild(handler, refuse)


def _as_client(handler: grpc.RpcMethodHandler, client: str) -> grpc.RpcMethodHandler:
    serve = behavior(handler)
    if inspect.isasyncgenfunction(serve):
        async def stream(request: Any, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[Any]:
            CURRENT_CLIENT.set(client)  # this call's task only: each call runs in its own
            async for item in serve(request, context):
                yield item

        return rebuild(handler, stream)

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        CURRENT_CLIENT.set(client)
        result = serve(request, context)
        return await result if inspect.isawaitable(result) else result

    return rebuild(handler, call)


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
