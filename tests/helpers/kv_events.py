"""A gRPC server carrying a worker's `WatchKVEvents` and nothing else, over a relay with
no engine behind it (vLLM's publisher class feeds it in the tests that need events): the
rest of DecodeService needs an engine. The handler is the workers' own
(`services.worker.kv_events.watch`), behind the interceptors of a worker's port."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services.server.channels import grpc_options
from services.server.listener import interceptors
from services.worker import kv_events
from services.worker.kv_events import EventRelay


class EventsOnly(wpb_grpc.DecodeServiceServicer):
    """WatchKVEvents as the prefill and decode servicers serve it."""

    def __init__(self, relay: EventRelay | None) -> None:
        self.relay = relay

    async def WatchKVEvents(self, req: wpb.WatchKVEventsRequest,
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[wpb.WatchKVEventsResponse]:
        async for batch in kv_events.watch(self.relay, context):
            yield batch


def plaintext(server: grpc.aio.Server, address: str) -> int:
    return server.add_insecure_port(address)


@contextlib.asynccontextmanager
async def events_server(relay: EventRelay | None, port: int = 0,
                        bind: Callable[[grpc.aio.Server, str], int] = plaintext
                        ) -> AsyncIterator[int]:
    """The server on a loopback port (`port`, or a free one), bound by `bind`; its port."""
    server = grpc.aio.server(interceptors=interceptors(None), options=grpc_options())
    wpb_grpc.add_DecodeServiceServicer_to_server(EventsOnly(relay), server)
    port = bind(server, f"127.0.0.1:{port}")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)
