"""The public API as one process serves it: `pdserve.v1.GenerationService` (with health
and reflection) on the public listener, and the OpenAI-compatible HTTP API beside it
when `http_port` is set, both over one backend, with the same credentials."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from services.api.backend import Backend
from services.api.servicer import generation_service
from services.engine import structured
from services.server.grpc_server import Bound, Companion, serve
from services.server.listener import Listener
from services.server.settings import ServerConfig


async def serve_public(config: ServerConfig, backend: Backend, banner: str,
                       on_ready: Callable[[Bound], None] | None = None,
                       stop: asyncio.Event | None = None) -> None:
    """Serve `backend` until SIGTERM/SIGINT (or `stop` is set), then drain both APIs.
    Refuses (`InsecureBindError`) to serve beyond loopback unauthenticated unless
    `config.allow_insecure`."""
    # Constraints are compile-checked with vLLM's validator: import it now, not while
    # the first constrained request waits.
    threading.Thread(target=structured.warm_up, name="structured-warm-up", daemon=True).start()
    listener = Listener.public(config)
    http: list[Companion] = []
    if config.http_port:
        from services.api.openai_http import HttpServer

        http.append(HttpServer(backend, config.host, config.http_port, config.grace_s,
                               auth=listener.auth, tool_parser=config.auto_tool_parser))
    await serve(config, [generation_service(backend)], banner, listener, on_ready, stop,
                companions=http)
