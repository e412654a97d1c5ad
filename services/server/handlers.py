"""Server interceptors' common tool: a method handler rebuilt around a new behavior,
of the same kind (unary or streaming, each way) and with the same (de)serializers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def kind(handler: grpc.RpcMethodHandler) -> str:
    """"unary_unary", "unary_stream", "stream_unary" or "stream_stream"."""
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"


def behavior(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    """The function that serves `handler`'s calls."""
    return getattr(handler, kind(handler))


def rebuild(handler: grpc.RpcMethodHandler, serve: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """`handler` with `serve` as its behavior."""
    return _FACTORIES[kind(handler)](serve, request_deserializer=handler.request_deserializer,
                                     response_serializer=handler.response_serializer)
