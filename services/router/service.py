"""`pdserve router`: the router as a standalone service (a Kubernetes pod, a Ray actor)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.api.public import serve_public
from services.engine.model import resolve_model
from services.observability import tracing
from services.registry.config import ClusterStateConfig
from services.registry.registry import Registry
from services.router.config import RouterConfig, model_folders
from services.router.router import RouterBackend
from services.security import redaction
from services.security.policy import internal_tls
from services.security.redaction import redact_url
from services.server.settings import ServerConfig

log = logging.getLogger(__name__)


async def run_router(server_cfg: ServerConfig, config: RouterConfig,
                     on_ready: Callable[[int], None] | None = None,
                     cluster: ClusterStateConfig | None = None,
                     stop: asyncio.Event | None = None) -> None:
    """Serve the public API over the workers registered in `config.redis_url` until
    SIGTERM/SIGINT (or `stop` is set), then drain; `on_ready` gets the bound gRPC port."""
    from transformers import AutoTokenizer

    if not config.redis_url:
        raise ValueError("the router needs --redis-url (or PDSERVE_REDIS_URL): workers "
                         "register there")
    redaction.register_url(config.redis_url)  # masked in every log line of this process
    tracing.setup_from(server_cfg, "pdserve-router")
    model_path = resolve_model(config.router_model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    # Several models: each one's tokenizer, the default first (`router_models`).
    models = [(name, AutoTokenizer.from_pretrained(str(resolve_model(folder))), folder)
              for name, folder in model_folders(config.router_models)]
    # Built before anything slow, so a missing cluster secret fails at once.
    signer = (cluster or ClusterStateConfig()).signer("router")  # type: ignore[call-arg]
    registry = Registry.from_url(config.redis_url, signer=signer,
                                 client_lease_s=config.client_lease_s)
    backend = RouterBackend(config, registry, tokenizer, str(model_path),
                            tls=internal_tls(server_cfg), models=models)
    try:
        log.info("waiting for workers to register in %s", redact_url(config.redis_url))
        await backend.start()
        await serve_public(server_cfg, backend,
                           f"pdserve router ({config.policy}) serving "
                           f"{', '.join(m.name for m in backend.served_models())}",
                           on_ready=lambda bound: on_ready(bound.port) if on_ready else None,
                           stop=stop)
    finally:
        await backend.close()
        await registry.close()
        tracing.shutdown_tracing()  # the last spans are exported before the process ends
