"""pdserve services inside Ray actors.

Each actor builds its service in `__init__` (so a Ray restart after a crash rebuilds
it: a new engine, a new restart epoch) and serves from the actor's event loop. Engines
run in-process, so when Ray kills an actor's process group their vLLM children go too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

from services.engine.config import EngineConfig
from services.launcher.actor_spec import RouterArgs, WorkerArgs
from services.observability.logs import LEVEL_ENV, setup_logging
from services.registry.signing import SECRET_ENV
from services.router.config import RouterConfig
from services.security import redaction
from services.server.settings import ServerConfig
from services.worker.config import WorkerConfig

log = logging.getLogger(__name__)


class ServiceActor:
    """One prefill worker, decode worker or router. Wrapped with `ray.remote` by the
    supervisor, which starts it with the role's `ActorSpec` (actor_spec.py)."""

    def __init__(self, args: WorkerArgs | RouterArgs) -> None:
        setup_logging(os.environ.get(LEVEL_ENV, "INFO"), quiet_libraries=True)
        if args.secret:  # registries in this process (and its engines') read it here
            os.environ[SECRET_ENV] = args.secret
        # What this actor holds that its log lines must never show.
        redaction.register(args.secret)
        redaction.register_url(args.worker.redis_url if isinstance(args, WorkerArgs)
                               else args.router.redis_url)
        self.role = args.role
        self.pid = os.getpid()
        loop = asyncio.get_running_loop()
        self._port: asyncio.Future[int] = loop.create_future()
        self._stop = asyncio.Event()  # drain(): leave rotation, finish streams, stop
        self._task: asyncio.Task[Any]
        if isinstance(args, WorkerArgs):
            worker_cfg = self._on_this_node(args.worker) if args.advertise_node_ip else args.worker
            self._task = loop.create_task(self._worker(args.role, args.server, args.engine,
                                                       worker_cfg))
        else:
            self._task = loop.create_task(self._router(args.server, args.router))

    @staticmethod
    def _on_this_node(config: WorkerConfig) -> WorkerConfig:
        """On a multi-node cluster peers reach this worker at its node's address, which
        only the actor knows (loopback would point them at their own node)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return config.model_copy(update={
            "advertise_host": config.advertise_host or ip,
            "kv_advertise_host": config.kv_advertise_host or ip,
        })

    def _ready(self, port: int) -> None:
        if not self._port.done():
            self._port.set_result(port)

    async def _worker(self, role: str, server_cfg: ServerConfig, engine_cfg: EngineConfig,
                      worker_cfg: WorkerConfig) -> None:
        from services.worker.serve import run_worker

        await run_worker(role, engine_cfg, server_cfg, worker_cfg,  # type: ignore[arg-type]
                         on_ready=self._ready, stop=self._stop)

    async def _router(self, server_cfg: ServerConfig, router_cfg: RouterConfig) -> None:
        from services.router.service import run_router

        await run_router(server_cfg, router_cfg, on_ready=self._ready, stop=self._stop)

    async def ready(self) -> dict[str, Any]:
        """Wait until the service listens; its port and process id."""
        done, _ = await asyncio.wait({self._port, self._task},
                                     return_when=asyncio.FIRST_COMPLETED)
        if self._task in done and not self._port.done():
            self._task.result()  # raises what stopped the service
            raise RuntimeError(f"the {self.role} service stopped before it was ready")
        return {"role": self.role, "port": self._port.result(), "pid": self.pid}

    async def drain(self) -> None:
        """Stop gracefully: a worker leaves the registry at once, the server refuses new
        calls and gives running streams up to its `grace_s` to finish, then the engine
        stops. Returns when the service has stopped (the launcher kills the actor then)."""
        self._stop.set()
        with contextlib.suppress(Exception):  # how it ended is logged by the service
            await self._task

    async def alive(self) -> bool:
        if self._task.done():
            self._task.result()
            return False
        return True
