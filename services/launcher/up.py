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
import time
import uuid
from pathlib import Path

from prometheus_client import start_http_server

from services.kv.tp_layout import LayoutRefused, kv_workers_tp_problem
from services.launcher.actor_spec import ROLES, ActorSpecs
from services.launcher.credentials import cluster_secret, stack_certificates
from services.launcher.desired import Desired, DesiredState
from services.launcher.models import check_models, default_served_name, extra_pools
from services.launcher.placement import stack_warning
from services.launcher.planning import live_planner, run_planner
from services.launcher.ray_cluster import start_ray
from services.launcher.settings import LOOPBACK, Stack, role_tp
from services.launcher.supervisor import ProbeSettings, Supervisor
from services.launcher.watch import Watch
from services.observability.discovery import TargetsFile
from services.observability.logs import driver_env
from services.registry.local_stack import STATE_FILE_ENV, LocalStack, remove_state, write_state
from services.registry.redis_server import RedisServer
from services.registry.registry import Registry, redis_client
from services.registry.signing import RecordSigner
from services.security import redaction
from services.security.redaction import redact_url

log = logging.getLogger(__name__)


def supervisor_for(stack: Stack, specs: ActorSpecs) -> Supervisor:
    """The stack's supervisor, probing and draining as its settings say."""
    return Supervisor(specs.spec, ProbeSettings.of(stack.launcher),
                      local_cluster=specs.local_cluster,
                      # the streams' grace, then the engine's own shutdown
                      drain_timeout_s=stack.server.grace_s + 20.0)


def _stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set `stop`: the stack then stops and cleans up."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def _forget(state: DesiredState) -> None:
    with contextlib.suppress(Exception):  # its Redis may be gone already
        await state.delete()


def _warn_if_cores_shared(stack: Stack, prefill: int, decode: int) -> None:
    """`prefill` and `decode`: the default model's pools; other models' add theirs."""
    extra = {role: sum(m.decode if role == "decode" else m.prefill
                       for m in stack.launcher.models) for role in ROLES}
    warning = stack_warning(stack, prefill + extra["prefill"], decode + extra["decode"])
    if warning:
        log.warning("%s", warning)


def served(stack: Stack, desired: Desired) -> str:
    """The pools, as the ready line tells them."""
    pools = f"{desired.prefill} prefill, {desired.decode} decode workers"
    if not stack.launcher.models:
        return pools
    return "; ".join([f"{default_served_name(stack.engine)}: {pools}", *(
        f"{m.served_name}: {m.prefill} prefill, {m.decode} decode workers"
        for m in stack.launcher.models)])


async def run_up(stack: Stack) -> None:
    """Run the stack until SIGTERM, SIGINT or `pdserve down`, then stop all of it."""
    started = time.monotonic()
    os.environ.update(driver_env(stack.log_level))
    import ray

    lc = stack.launcher
    planner = live_planner(stack)  # a setting that cannot work stops here, before anything
    problem = kv_workers_tp_problem(role_tp(lc, stack.engine, "prefill"),
                                    role_tp(lc, stack.engine, "decode"))
    if problem:
        raise LayoutRefused(problem)
    check_models(stack.engine, lc.models, planner=planner is not None)
    for entry in lc.models:  # each model's pools move KV between themselves only
        engine = entry.engine(stack.engine)
        if problem := kv_workers_tp_problem(entry.tp or role_tp(lc, engine, "prefill"),
                                            entry.tp or role_tp(lc, engine, "decode")):
            raise LayoutRefused(f"{entry.served_name}: {problem}")
    pools = extra_pools(lc.models)  # the other models' pools keep these sizes
    if lc.state_file:
        os.environ[STATE_FILE_ENV] = lc.state_file
    stop = asyncio.Event()
    # From the start: a stop while the stack starts cleans up like any other.
    _stop_on_signals(stop)
    if lc.supervisor_metrics_port:
        start_http_server(lc.supervisor_metrics_port, addr=LOOPBACK)
    state_file: Path | None = None

    def forget_state_file() -> None:
        if state_file is not None:  # never another stack's
            remove_state()

    # Every cleanup is registered as soon as there is something to clean up, and runs
    # (in reverse) however the stack ends: a stop, an error, a failed start. The state
    # file goes last: `pdserve down` waits for it.
    async with contextlib.AsyncExitStack() as cleanup:
        cleanup.callback(forget_state_file)
        local_redis = None
        redis_url = stack.router.redis_url
        if not redis_url:
            local_redis = RedisServer().start()
            cleanup.callback(local_redis.cleanup)
            redis_url = local_redis.url
            log.info("started redis-server at %s", redact_url(redis_url))
        secret = cluster_secret(stack.cluster)
        redaction.register(secret)
        redaction.register_url(redis_url)
        redis = redis_client(redis_url, timeout_s=2.0)
        cleanup.push_async_callback(redis.aclose)
        signer = RecordSigner(secret.encode() if secret else None)
        state = DesiredState(redis, signer)
        desired = Desired(lc.prefill, lc.decode, lc.routers, stack=uuid.uuid4().hex).updated()
        await state.write(desired)
        cleanup.push_async_callback(_forget, state)
        tls = stack_certificates(stack)
        if tls is not None:
            cleanup.callback(tls.close)
        # Prometheus file-based discovery of every metrics endpoint, kept current from Redis.
        targets = TargetsFile.of_stack(lc.prometheus_sd_file, Registry(redis, signer=signer),
                                       stack.server)
        state_file = write_state(LocalStack(redis_url, secret,
                                            str(tls.directory) if tls else "",
                                            targets.router_addresses))
        await asyncio.sleep(0)  # a signal that came during the steps above sets `stop` now
        if stop.is_set():
            return
        cleanup.callback(ray.shutdown)  # also after a start cut short
        start_ray(lc, stack.log_level)
        _stop_on_signals(stop)  # again: ray.init put its own SIGTERM handler in place
        supervisor = supervisor_for(stack, ActorSpecs(stack, redis_url, secret, tls))
        cleanup.push_async_callback(supervisor.stop_all)
        watch = Watch(state, desired, local_redis)
        targets.start()
        cleanup.push_async_callback(targets.close)
        log.info("Prometheus targets (file_sd_configs) in %s", targets.path)
        _warn_if_cores_shared(stack, desired.prefill, desired.decode)
        for role in ROLES:
            supervisor.ensure(role, getattr(desired, role))
        for pool, size in pools:
            supervisor.ensure(pool.key, size)
        supervisor.ensure("router", lc.routers)
        ready = asyncio.ensure_future(supervisor.wait_ready(lc.actor_start_timeout_s))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return
        stopping.cancel()
        router = ready.result()["router-0"]
        print(f"ready in {time.monotonic() - started:.0f} s: pdserve is up, router on "
              f"{stack.server.host}:{router['port']} ({served(stack, desired)}; Redis "
              f"{redact_url(redis_url)}; state in {state_file})", flush=True)
        probing = asyncio.create_task(supervisor.watch())
        cleanup.callback(probing.cancel)
        if planner is not None:
            registry = Registry(redis, signer=signer)
            planning = asyncio.create_task(run_planner(planner, registry, watch))
            cleanup.callback(planning.cancel)
        sizes = (desired.prefill, desired.decode)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            await watch.keep_redis()
            want = await watch.read()
            if want.down:
                break
            if (want.prefill, want.decode) != sizes:  # `pdserve scale`, the planner
                sizes = (want.prefill, want.decode)
                _warn_if_cores_shared(stack, *sizes)
            for role in ROLES:
                supervisor.ensure(role, getattr(want, role))
            for pool, size in pools:
                supervisor.ensure(pool.key, size)
            supervisor.ensure("router", lc.routers)
