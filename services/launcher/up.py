"""`pdserve up | scale | down`: the whole stack on Ray.

`pdserve up` starts (or joins) a Ray cluster, starts `redis-server` on loopback when no
Redis URL is given, and keeps the router and the prefill and decode pools at their
desired sizes: a supervisor loop reconciles named actors with the sizes stored in Redis
(`pdserve scale` writes them, `pdserve down` asks for shutdown). Ray restarts a crashed
actor (a new engine with a new restart epoch); the supervisor replaces one that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.api.server import ServerConfig
from services.engine.config import EngineConfig
from services.engine.model import models_dir
from services.registry.redis_server import RedisServer
from services.router.config import RouterConfig
from services.workers import WorkerConfig

log = logging.getLogger(__name__)

DESIRED_KEY = "pdserve:desired"
STATE_FILE = "up.json"  # where `scale` and `down` find a local stack's Redis
ROLES = ("prefill", "decode")


class LauncherConfig(BaseSettings):
    """`pdserve up`: pool sizes and placement. Env prefix PDSERVE_."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    prefill: int = Field(1, ge=0, description="prefill workers")
    decode: int = Field(1, ge=1, description="decode workers")
    routers: int = Field(1, ge=1, description="router replicas (the first on --port, the "
                         "others on free ports)")
    ray_address: str = Field("", description="Ray cluster to join (e.g. ray://head:10001 or "
                             "auto); empty = start a local one")
    prefill_cores: str = Field("", description="CPU: cores prefill workers are pinned to; "
                               "default: the first half")
    decode_cores: str = Field("", description="CPU: cores decode workers are pinned to; "
                              "default: the second half")
    prefill_accelerator: str = Field("", description="GPU: Ray accelerator type for prefill "
                                     "workers (compute-class, e.g. H100)")
    decode_accelerator: str = Field("", description="GPU: Ray accelerator type for decode "
                                    "workers (bandwidth-class, e.g. H200)")


def state_path() -> Path:
    return models_dir().parent / STATE_FILE


@dataclass
class Stack:
    launcher: LauncherConfig
    engine: EngineConfig
    server: ServerConfig
    worker: WorkerConfig
    router: RouterConfig


class Supervisor:
    def __init__(self, stack: Stack, redis_url: str) -> None:
        import ray

        from services.launcher.actors import ServiceActor

        self.ray = ray
        self.stack = stack
        self.redis_url = redis_url
        self.remote = ray.remote(ServiceActor)
        self.actors: dict[str, Any] = {}

    def _options(self, role: str, name: str) -> dict[str, Any]:
        lc = self.stack.launcher
        options: dict[str, Any] = {
            "name": name, "namespace": "pdserve", "max_restarts": -1, "max_task_retries": 0,
            "max_concurrency": 64, "resources": {f"pdserve_{role}": 1},
        }
        accelerator = {"prefill": lc.prefill_accelerator, "decode": lc.decode_accelerator}.get(
            role, "")
        if accelerator:
            options.update(num_gpus=1, accelerator_type=accelerator)
        else:
            # CPU: vLLM pins its worker to the role's cores; Ray's CPU accounting would only
            # keep three engines off a two-core machine.
            options["num_cpus"] = 0
        return options

    def _args(self, role: str, index: int) -> tuple[Any, ...]:
        from services.router.local import split_cores

        s = self.stack
        server = s.server.model_copy(update={"port": 0, "metrics_port": -1, "http_port": 0})
        if role == "router":
            if index == 0:
                server = s.server.model_copy()
            router = s.router.model_copy(update={"redis_url": self.redis_url})
            return (role, server, None, None, router, False)
        cores = dict(zip(ROLES, split_cores(s.launcher.prefill_cores, s.launcher.decode_cores),
                         strict=True))[role]
        engine = s.engine.model_copy(update={"cpu_cores": cores})
        worker = s.worker.model_copy(update={"redis_url": self.redis_url,
                                             "worker_id": f"{role}-{index}"})
        # Joining a cluster: workers may land on other nodes, so they advertise their
        # node's address; a local cluster keeps everything on loopback.
        return (role, server, engine, worker, None, bool(s.launcher.ray_address))

    def ensure(self, role: str, count: int) -> None:
        for i in range(count):
            name = f"{role}-{i}"
            if name not in self.actors:
                log.info("starting %s", name)
                self.actors[name] = self.remote.options(**self._options(role, name)).remote(
                    *self._args(role, i))
        extra = sorted((n for n in self.actors if n.startswith(f"{role}-")
                        and int(n.rsplit("-", 1)[1]) >= count), reverse=True)
        for name in extra:
            log.info("stopping %s", name)
            self.ray.kill(self.actors.pop(name), no_restart=True)

    async def wait_ready(self, timeout: float = 900.0) -> dict[str, dict[str, Any]]:
        names = list(self.actors)
        infos = await asyncio.wait_for(
            asyncio.gather(*(self.actors[n].ready.remote() for n in names)), timeout)
        return dict(zip(names, infos, strict=True))

    def stop_all(self) -> None:
        for handle in self.actors.values():
            with contextlib.suppress(Exception):
                self.ray.kill(handle, no_restart=True)
        self.actors.clear()


async def desired_sizes(redis: Any, default: dict[str, int]) -> dict[str, Any]:
    raw = await redis.get(DESIRED_KEY)
    return {**default, **json.loads(raw)} if raw else dict(default)


async def run_up(stack: Stack) -> None:
    import ray
    import redis.asyncio as aioredis

    lc = stack.launcher
    local_redis = None
    redis_url = stack.router.redis_url
    if not redis_url:
        local_redis = RedisServer().start()
        redis_url = local_redis.url
        log.info("started redis-server at %s", redis_url)
    redis = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
    sizes = {"prefill": lc.prefill, "decode": lc.decode, "routers": lc.routers}
    await redis.set(DESIRED_KEY, json.dumps(sizes))
    state_path().parent.mkdir(parents=True, exist_ok=True)
    state_path().write_text(json.dumps({"redis_url": redis_url}))
    if lc.ray_address:
        ray.init(address=lc.ray_address, namespace="pdserve")
    else:
        # Per-role custom resources: a real cluster gives them to the node types that
        # should host each role (see deploy/ray-cluster.yaml); locally every role fits.
        ray.init(namespace="pdserve", include_dashboard=False, log_to_driver=True,
                 object_store_memory=256 << 20,
                 resources={"pdserve_prefill": 64, "pdserve_decode": 64, "pdserve_router": 64})
    supervisor = Supervisor(stack, redis_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for role in ROLES:
            supervisor.ensure(role, sizes[role])
        supervisor.ensure("router", lc.routers)
        ready = asyncio.ensure_future(supervisor.wait_ready())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return
        stopping.cancel()
        router = ready.result()["router-0"]
        print(f"pdserve is up: router on {stack.server.host}:{router['port']} "
              f"({sizes['prefill']} prefill, {sizes['decode']} decode workers; "
              f"Redis {redis_url})", flush=True)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            try:
                want = await desired_sizes(redis, sizes)
            except Exception as e:  # Redis restarting: keep the pools as they are
                log.warning("cannot read desired sizes: %s", e)
                continue
            if want.get("down"):
                break
            if want != sizes:
                log.info("scaling to %s", want)
                sizes = want
                for role in ROLES:
                    supervisor.ensure(role, int(sizes[role]))
    finally:
        supervisor.stop_all()
        ray.shutdown()
        with contextlib.suppress(Exception):
            await redis.delete(DESIRED_KEY)
        await redis.aclose()
        if local_redis is not None:
            local_redis.stop()
        with contextlib.suppress(FileNotFoundError):
            state_path().unlink()


async def set_desired(redis_url: str, update: dict[str, Any]) -> dict[str, Any]:
    import redis.asyncio as aioredis

    redis = aioredis.Redis.from_url(redis_url or _local_redis_url(), socket_timeout=2.0)
    try:
        raw = await redis.get(DESIRED_KEY)
        if raw is None:
            raise RuntimeError("no pdserve stack is running on that Redis (`pdserve up` first)")
        want = {**json.loads(raw), **update}
        await redis.set(DESIRED_KEY, json.dumps(want))
        return want
    finally:
        await redis.aclose()


def _local_redis_url() -> str:
    try:
        return str(json.loads(state_path().read_text())["redis_url"])
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError("no local pdserve stack found; pass --redis-url") from e
