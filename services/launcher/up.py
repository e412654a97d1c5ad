"""`pdserve up | scale | down`: the whole stack on Ray.

`pdserve up` starts (or joins) a Ray cluster and, when no Redis URL is given, a
`redis-server` on loopback with a generated password. It signs what it keeps in Redis
under a cluster secret (generated unless one is set) and hands the Redis URL and the
secret to its actors. Then it keeps the router and the prefill and decode pools at their
desired sizes, every second:

- reconcile: the desired sizes come from Redis (`pdserve scale` writes them, `pdserve
  down` asks for shutdown; signed, see `desired.py`); missing actors are started, extra
  ones stopped, and the launcher puts its state back if the key is gone or forged;
- watchdog: a local redis-server that died is started again on the same port with the
  same password, and the desired sizes are written back at once (workers re-register
  with their next heartbeat; routers keep their last view meanwhile);
- probes: the supervisor (`supervisor.py`) probes each actor and kills one that hangs or
  whose service stopped, so Ray restarts it; Ray itself restarts actors that crash.

A local Ray cluster uses a loopback node address, no dashboard and Ray's token
authentication (on by default in this Ray). Ray still binds its GCS, raylet, object
manager and every worker's core-worker port on all interfaces (they take no bind
address); those are Ray's, token-authenticated. pdserve's own ports (router, workers,
metrics, KV receiver, Redis, the supervisor's metrics) are on loopback in a local stack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import uuid
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.api.server import ServerConfig
from services.engine.config import EngineConfig, cpu_only, split_cores, with_step_bounds
from services.launcher.desired import Desired, DesiredState, remove_state, write_state
from services.launcher.desired import set_desired as set_desired
from services.launcher.desired import state_path as state_path
from services.launcher.planning import live_planner, run_planner
from services.launcher.supervisor import ROLES, ProbeSettings
from services.launcher.supervisor import Supervisor as BaseSupervisor
from services.registry.config import ClusterStateConfig
from services.registry.records import BadRecord
from services.registry.redis_server import RedisServer, redact
from services.registry.registry import BAD_RECORDS, Registry, redis_client
from services.registry.signing import SECRET_ENV, RecordSigner, load_secret, new_secret
from services.router.config import RouterConfig
from services.security.stack import StackCertificates, has_internal_tls
from services.settings import from_arguments
from services.worker.config import WorkerConfig

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
REDIS_RESTARTS = Counter("pdserve_supervisor_redis_restarts", "times the local "
                         "redis-server was found dead and started again")


class LauncherConfig(BaseSettings):
    """`pdserve up`: pool sizes, placement and supervision. Env prefix PDSERVE_."""

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
    actor_probe_interval_s: float = Field(2.0, gt=0, description="seconds between health "
                                          "probes of each actor by the supervisor")
    actor_probe_timeout_s: float = Field(5.0, gt=0, description="an actor's probe unanswered "
                                         "this long is a miss")
    actor_probe_failures: int = Field(2, ge=1, description="misses in a row before a hung "
                                      "actor is killed and restarted")
    actor_start_timeout_s: float = Field(900.0, gt=0, description="an actor not ready this "
                                         "long after a (re)start is restarted")
    stack_tls: bool = Field(True, description="make a CA for this stack at start, so its "
                            "internal channels are mutual TLS (local cluster; ignored when "
                            "--internal-tls-*-file are given)")
    supervisor_metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus port of the supervisor's own counters "
        "(restarts), on loopback (0 = off)")
    state_file: str = Field("", description="where `scale` and `down` find a local stack's "
                            "Redis URL and secret (mode 0600); default up.json beside the "
                            "models cache")
    planner_profile: str = Field(
        "", description="GPU stacks: a `pdserve plan profile` JSON; set, the live planner "
        "moves workers between the prefill and decode pools (their total stays) to the split "
        "it predicts serves the observed traffic best (README, \"The live planner\")")
    planner_slo: str = Field("ttft=0.5,itl=0.05", description="the live planner's SLOs, "
                             "NAME=SECONDS,... (ttft, tpot, itl, e2e): goodput is requests/s "
                             "within all of them")
    planner_interval_s: float = Field(60.0, gt=0, description="seconds of traffic the live "
                                      "planner observes per decision")
    planner_cooldown_s: float = Field(300.0, ge=0, description="at least this long between "
                                      "two changes of the split")
    planner_min_prefill: int = Field(1, ge=0, description="the live planner's floor for the "
                                     "prefill pool (0 lets it choose colocated serving)")
    planner_min_decode: int = Field(1, ge=1, description="the live planner's floor for the "
                                    "decode pool")
    planner_margin: float = Field(0.2, ge=0, description="change the split only when the "
                                  "best one's predicted goodput beats the current one's by "
                                  "more than this share (the planner's error against real "
                                  "runs; smaller gains are noise)")


@dataclass
class Stack:
    launcher: LauncherConfig
    engine: EngineConfig
    server: ServerConfig
    worker: WorkerConfig
    router: RouterConfig
    cluster: ClusterStateConfig = field(
        default_factory=lambda: ClusterStateConfig())  # type: ignore[call-arg]


def stack_from_args(args: argparse.Namespace) -> Stack:
    """The stack `pdserve up` runs: its settings, engine steps bounded on a CPU host."""
    engine = with_step_bounds(from_arguments(EngineConfig, args), cpu_only())
    return Stack(from_arguments(LauncherConfig, args), engine,
                 from_arguments(ServerConfig, args), from_arguments(WorkerConfig, args),
                 from_arguments(RouterConfig, args),
                 cluster=from_arguments(ClusterStateConfig, args))


class Supervisor(BaseSupervisor):
    """The stack's supervisor: how each role's actor is made (Ray options and
    constructor arguments)."""

    redis_url = ""
    secret = ""

    def __init__(self, stack: Stack, redis_url: str, secret: str,
                 tls: StackCertificates | None = None) -> None:
        lc = stack.launcher
        self.tls = tls  # this stack's own CA, when it made one
        super().__init__(ProbeSettings(lc.actor_probe_interval_s, lc.actor_probe_timeout_s,
                                       lc.actor_probe_failures, lc.actor_start_timeout_s),
                         local_cluster=not lc.ray_address,
                         # the streams' grace, then the engine's own shutdown
                         drain_timeout_s=stack.server.grace_s + 20.0)
        self.stack, self.redis_url, self.secret = stack, redis_url, secret

    def _options(self, role: str, name: str) -> dict[str, Any]:
        lc = self.stack.launcher
        options: dict[str, Any] = {
            "name": name, "namespace": "pdserve", "max_restarts": -1, "max_task_retries": 0,
            "max_concurrency": 64, "resources": {f"pdserve_{role}": 1},
        }
        if self.secret:
            # Registries in the actors read it (services/registry/signing.py).
            options["runtime_env"] = {"env_vars": {SECRET_ENV: self.secret}}
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
        s = self.stack
        # Only the first router keeps the configured ports (the health-only one included:
        # several actors of one node would collide on it).
        server = s.server.model_copy(update={"port": 0, "metrics_port": -1, "http_port": 0,
                                             "health_port": 0})
        if self.local_cluster:
            # Internal ports of a local stack are for this machine only.
            server = server.model_copy(update={"host": LOOPBACK})
        if role == "router":
            if index == 0:
                server = s.server.model_copy()
            if self.tls is not None:
                server = server.model_copy(update=self.tls.settings(role))
            router = s.router.model_copy(update={"redis_url": self.redis_url})
            return (role, server, None, None, router, False)
        cores = dict(zip(ROLES, split_cores(s.launcher.prefill_cores, s.launcher.decode_cores),
                         strict=True))[role]
        engine = s.engine.model_copy(update={"cpu_cores": cores})
        update: dict[str, Any] = {"redis_url": self.redis_url, "worker_id": f"{role}-{index}"}
        if self.local_cluster:
            update["kv_host"] = LOOPBACK
        worker = s.worker.model_copy(update=update)
        if self.tls is not None:
            server = server.model_copy(update=self.tls.settings(role))
        # Joining a cluster: workers may land on other nodes, so they advertise their
        # node's address; a local cluster keeps everything on loopback.
        return (role, server, engine, worker, None, not self.local_cluster)


def _init_ray(lc: LauncherConfig) -> None:
    import ray

    if lc.ray_address:
        ray.init(address=lc.ray_address, namespace="pdserve")
        return
    # Per-role custom resources: a real cluster gives them to the node types that should
    # host each role (see deploy/ray-cluster.yaml); locally every role fits. Loopback
    # node address, no dashboard (its jobs API runs code); token auth stays on.
    ray.init(namespace="pdserve", include_dashboard=False, log_to_driver=True,
             object_store_memory=256 << 20, _node_ip_address=LOOPBACK,
             resources={"pdserve_prefill": 64, "pdserve_decode": 64, "pdserve_router": 64})


def stack_certificates(stack: Stack) -> StackCertificates | None:
    """A CA for this stack (mTLS on its internal channels) unless it has internal TLS
    files of its own or is told not to. Only on a local cluster: actors on other nodes
    could not read files made here (there, give every node the same files)."""
    if has_internal_tls(stack.server) or not stack.launcher.stack_tls:
        return None
    if stack.launcher.ray_address:
        log.warning("pdserve up on a Ray cluster without --internal-tls-*-file: the "
                    "internal channels (router -> workers, KV transfers) are not encrypted")
        return None
    return StackCertificates()


def _secret(cluster: ClusterStateConfig) -> str:
    """The stack's cluster secret: the configured one, none when unsigned records are
    explicitly allowed, else a new one for this stack."""
    key = load_secret(cluster.cluster_secret.get_secret_value(), cluster.cluster_secret_file)
    if key is not None:
        return key.decode()
    if cluster.allow_unsigned_records:
        log.warning("pdserve up: cluster records are NOT signed (--allow-unsigned-records): "
                    "anyone who can write to Redis can register a worker or stop the stack")
        return ""
    return new_secret()


class Watch:
    """The launcher's view of its desired state, and its local redis-server."""

    def __init__(self, state: DesiredState, desired: Desired,
                 local_redis: RedisServer | None) -> None:
        self.state = state
        self.desired = desired
        self.local_redis = local_redis
        self._complained = ""  # the last problem logged (log each once)

    def _once(self, problem: str) -> None:
        if problem != self._complained:
            log.warning("%s", problem)
            self._complained = problem

    async def keep_redis(self) -> None:
        r = self.local_redis
        if r is None or r.alive:
            return
        log.warning("the local redis-server died (exit %s); starting it again",
                    r.proc.returncode if r.proc else None)
        try:
            await asyncio.to_thread(r.start)
        except RuntimeError as e:
            self._once(f"cannot restart redis-server: {e}; retrying")
            return
        REDIS_RESTARTS.inc()
        with contextlib.suppress(Exception):
            await self.state.write(self.desired)
            log.info("redis-server is back; desired sizes written again")

    async def read(self) -> Desired:
        """The desired state to act on (the current one when Redis says nothing valid)."""
        try:
            want = await self.state.read()
        except BadRecord as e:
            BAD_RECORDS.labels(e.reason).inc()
            self._once(f"ignoring the desired state in Redis: {e}")
            want = None
        except Exception as e:  # Redis restarting: keep the pools as they are
            self._once(f"cannot read the desired sizes: {e}")
            return self.desired
        if want is not None and (want.stack != self.desired.stack
                                 or want.version < self.desired.version):
            self._once("ignoring a desired state of another stack or an older version")
            want = None
        if want is None:  # gone (Redis restarted) or not ours: put ours back
            with contextlib.suppress(Exception):
                await self.state.write(self.desired)
            return self.desired
        self._complained = ""
        self.desired = want
        return want


async def run_up(stack: Stack) -> None:
    import ray

    lc = stack.launcher
    planner = live_planner(stack)  # a setting that cannot work stops here, before anything
    if lc.state_file:
        import os

        from services.launcher.desired import STATE_FILE_ENV

        os.environ[STATE_FILE_ENV] = lc.state_file
    if lc.supervisor_metrics_port:
        from prometheus_client import start_http_server

        start_http_server(lc.supervisor_metrics_port, addr=LOOPBACK)
    local_redis = None
    redis_url = stack.router.redis_url
    if not redis_url:
        local_redis = RedisServer().start()
        redis_url = local_redis.url
        log.info("started redis-server at %s", redact(redis_url))
    secret = _secret(stack.cluster)
    redis = redis_client(redis_url, timeout_s=2.0)
    signer = RecordSigner(secret.encode() if secret else None)
    state = DesiredState(redis, signer)
    desired = Desired(lc.prefill, lc.decode, lc.routers, stack=uuid.uuid4().hex).updated()
    await state.write(desired)
    tls = stack_certificates(stack)
    state_file = write_state(redis_url, secret, str(tls.directory) if tls else "")
    _init_ray(lc)
    supervisor = Supervisor(stack, redis_url, secret, tls)
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
