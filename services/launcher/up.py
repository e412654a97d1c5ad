"""`pdserve up`: the whole stack on Ray, kept at its desired sizes.

`pdserve up` starts (or joins) a Ray cluster (`ray_cluster.py`) and, when no Redis URL is
given, a `redis-server` on loopback with a generated password. It signs what it keeps in
Redis under a cluster secret (generated unless one is set; `credentials.py`) and hands
the Redis URL and the secret to its actors (`actor_spec.py`). Then it keeps the router
and the prefill and decode pools at their desired sizes, every second:

- reconcile: the desired sizes come from Redis (`pdserve scale` writes them, `pdserve
  down` asks for shutdown; signed, see `desired.py`); missing actors are started, extra
  ones stopped, and the launcher puts its state back if the key is gone or forged;
- watchdog: a local redis-server that died is started again (`watch.py`);
- probes: the supervisor (`supervisor.py`) probes each actor and kills one that hangs or
  whose service stopped, so Ray restarts it; Ray itself restarts actors that crash;
- the live planner, when asked for (`planning.py`), changes the split like `pdserve scale`.

pdserve's own ports (router, workers, metrics, KV receiver, Redis, the supervisor's
metrics) are on loopback in a local stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import uuid

from prometheus_client import start_http_server

from services.launcher.actor_spec import ROLES, ActorSpecs
from services.launcher.credentials import cluster_secret, stack_certificates
from services.launcher.desired import Desired, DesiredState
from services.launcher.planning import live_planner, run_planner
from services.launcher.ray_cluster import start_ray
from services.launcher.settings import LOOPBACK, Stack
from services.launcher.supervisor import ProbeSettings, Supervisor
from services.launcher.watch import Watch
from services.registry.local_stack import STATE_FILE_ENV, LocalStack, remove_state, write_state
from services.registry.redis_server import RedisServer, redact
from services.registry.registry import Registry, redis_client
from services.registry.signing import RecordSigner

log = logging.getLogger(__name__)


def supervisor_for(stack: Stack, specs: ActorSpecs) -> Supervisor:
    """The stack's supervisor, probing and draining as its settings say."""
    return Supervisor(specs.spec, ProbeSettings.of(stack.launcher),
                      local_cluster=specs.local_cluster,
                      # the streams' grace, then the engine's own shutdown
                      drain_timeout_s=stack.server.grace_s + 20.0)


async def run_up(stack: Stack) -> None:
    """Run the stack until SIGTERM, SIGINT or `pdserve down`, then stop all of it."""
    import ray

    lc = stack.launcher
    planner = live_planner(stack)  # a setting that cannot work stops here, before anything
    if lc.state_file:
        os.environ[STATE_FILE_ENV] = lc.state_file
    if lc.supervisor_metrics_port:
        start_http_server(lc.supervisor_metrics_port, addr=LOOPBACK)
    local_redis = None
    redis_url = stack.router.redis_url
    if not redis_url:
        local_redis = RedisServer().start()
        redis_url = local_redis.url
        log.info("started redis-server at %s", redact(redis_url))
    secret = cluster_secret(stack.cluster)
    redis = redis_client(redis_url, timeout_s=2.0)
    signer = RecordSigner(secret.encode() if secret else None)
    state = DesiredState(redis, signer)
    desired = Desired(lc.prefill, lc.decode, lc.routers, stack=uuid.uuid4().hex).updated()
    await state.write(desired)
    tls = stack_certificates(stack)
    state_file = write_state(LocalStack(redis_url, secret, str(tls.directory) if tls else ""))
    start_ray(lc)
    supervisor = supervisor_for(stack, ActorSpecs(stack, redis_url, secret, tls))
    watch = Watch(state, desired, local_redis)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    probing: asyncio.Task[None] | None = None
    planning: asyncio.Task[None] | None = None
    try:
        for role in ROLES:
            supervisor.ensure(role, getattr(desired, role))
        supervisor.ensure("router", lc.routers)
        ready = asyncio.ensure_future(supervisor.wait_ready(lc.actor_start_timeout_s))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return
        stopping.cancel()
        router = ready.result()["router-0"]
        print(f"pdserve is up: router on {stack.server.host}:{router['port']} "
              f"({desired.prefill} prefill, {desired.decode} decode workers; Redis "
              f"{redact(redis_url)}; state in {state_file})", flush=True)
        probing = asyncio.create_task(supervisor.watch())
        if planner is not None:
            registry = Registry(redis, signer=signer)
            planning = asyncio.create_task(run_planner(planner, registry, watch))
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            await watch.keep_redis()
            want = await watch.read()
            if want.down:
                break
            for role in ROLES:
                supervisor.ensure(role, getattr(want, role))
            supervisor.ensure("router", lc.routers)
    finally:
        for task in (probing, planning):
            if task is not None:
                task.cancel()
        await supervisor.stop_all()
        ray.shutdown()
        with contextlib.suppress(Exception):
            await state.delete()
        await redis.aclose()
        if local_redis is not None:
            local_redis.cleanup()
        if tls is not None:
            tls.close()
        remove_state()
