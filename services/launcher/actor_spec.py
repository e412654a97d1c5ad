"""How each actor of a `pdserve up` stack is made: its Ray options (placement, restart
policy, environment) and what `ServiceActor` is constructed with, per role.

Ports: only the first router keeps the configured ones; every other actor takes free
ports (several actors of one node would collide on the configured ones, the health-only
port included). On a local cluster every internal port and the KV receiver are on
loopback; joining a cluster, workers advertise their node's address instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from services.engine.config import EngineConfig, split_cores
from services.launcher.models import Pool, default_folder, default_served_name
from services.launcher.settings import LOOPBACK, LauncherConfig, Stack, role_engine
from services.observability.logs import quiet_env
from services.router.config import RouterConfig
from services.security.stack import StackCertificates
from services.server.settings import ServerConfig
from services.worker.config import WorkerConfig

ROLES = ("prefill", "decode")  # the worker roles; each stack also has routers
NAMESPACE = "pdserve"


@dataclass(frozen=True, slots=True)
class RayOptions:
    """How Ray places, restarts and configures one actor."""

    name: str  # the actor's name in the namespace, e.g. decode-1
    role: str  # prefill, decode or router: the custom resource it takes
    accelerator: str = ""  # a Ray accelerator type: one GPU of it per rank; "" = CPU actor
    env: tuple[tuple[str, str], ...] = ()  # more environment variables of the actor
    ranks: int = 1  # tensor-parallel ranks of a worker: GPUs it takes

    @classmethod
    def of(cls, launcher: LauncherConfig, role: str, name: str, ranks: int = 1) -> RayOptions:
        accelerator = {"prefill": launcher.prefill_accelerator,
                       "decode": launcher.decode_accelerator}.get(role, "")
        return cls(name, role, accelerator, ranks=ranks)

    @property
    def role_resource(self) -> dict[str, float]:
        return {f"pdserve_{self.role}": 1}

    def bundles(self) -> list[dict[str, float]]:
        """A GPU worker of several ranks is one actor in a placement group of one bundle
        per rank, packed on one node: vLLM, started inside it, finds the group and puts
        one rank on each bundle's GPU. The first bundle also holds the actor's own role
        resource. Empty: no placement group (CPU workers, whose ranks are bound to the
        cores their settings give, and one-GPU workers)."""
        if not self.accelerator or self.ranks == 1:
            return []
        gpu = {"GPU": 1.0, f"accelerator_type:{self.accelerator}": 0.001}
        return [{**gpu, **self.role_resource}, *([gpu] * (self.ranks - 1))]

    def kwargs(self) -> dict[str, Any]:
        """The options as `ActorClass.options(**kwargs)` takes them (a placement group's
        scheduling strategy is added by whoever creates the group, see `bundles`)."""
        options: dict[str, Any] = {
            "name": self.name, "namespace": NAMESPACE, "max_restarts": -1,
            "max_task_retries": 0, "max_concurrency": 64,
            "resources": self.role_resource,
        }
        if self.env:
            # Never a secret: Ray's runtime-env agent logs these (the cluster secret
            # travels in the actor's arguments, `WorkerArgs.secret`).
            options["runtime_env"] = {"env_vars": dict(self.env)}
        if self.bundles():
            # The ranks' GPUs are the group's; the actor itself takes none of them.
            options.update(num_gpus=0, num_cpus=0)
        elif self.accelerator:
            options.update(num_gpus=1, accelerator_type=self.accelerator)
        else:
            # CPU: vLLM pins its workers to the role's cores; Ray's CPU accounting would
            # only keep three engines off a two-core machine.
            options["num_cpus"] = 0
        return options


def ray_options(options: RayOptions) -> tuple[dict[str, Any], Any]:
    """`options.kwargs()`, and for a worker of several GPUs a new placement group of its
    bundles (`RayOptions.bundles`) with the actor scheduled into its first bundle; the
    group is returned too (None for none), for whoever ends the actor to remove it."""
    kwargs = options.kwargs()
    bundles = options.bundles()
    if not bundles:
        return kwargs, None
    from ray.util import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group(bundles, strategy="STRICT_PACK")  # TP ranks on one node
    # Child tasks (vLLM's rank workers) land in the group's bundles too.
    kwargs["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
    return kwargs, group


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What a prefill or decode worker actor is constructed with."""

    role: str  # prefill or decode
    server: ServerConfig
    engine: EngineConfig
    worker: WorkerConfig
    # Joining a cluster: the worker may land on another node, so it advertises that
    # node's address, which only the actor knows.
    advertise_node_ip: bool = False
    secret: str = field(default="", repr=False)  # the cluster secret ("" = none)


@dataclass(frozen=True, slots=True)
class RouterArgs:
    """What a router actor is constructed with."""

    server: ServerConfig
    router: RouterConfig
    secret: str = field(default="", repr=False)  # the cluster secret ("" = none)

    @property
    def role(self) -> str:
        return "router"


@dataclass(frozen=True, slots=True)
class ActorSpec:
    """One actor as the supervisor starts it."""

    options: RayOptions
    args: WorkerArgs | RouterArgs


class ActorSpecs:
    """The specs of one stack's actors, from its settings, its Redis, its cluster secret
    and its own CA (when it made one)."""

    def __init__(self, stack: Stack, redis_url: str, secret: str,
                 tls: StackCertificates | None = None) -> None:
        self.stack, self.redis_url, self.secret, self.tls = stack, redis_url, secret, tls

    @property
    def local_cluster(self) -> bool:
        return not self.stack.launcher.ray_address

    def spec(self, role: str, index: int) -> ActorSpec:
        """The actor `index` of `role`: the router, or a worker pool (prefill, decode,
        or another model's `m{k}-prefill`, `m{k}-decode`: `Pool`)."""
        if role == "router":
            options = RayOptions.of(self.stack.launcher, role, f"{role}-{index}")
            args: WorkerArgs | RouterArgs = self.router(index)
        else:
            args = self.worker(role, index)
            pool = Pool.parse(role)
            options = RayOptions.of(self.stack.launcher, pool.role, f"{role}-{index}",
                                    args.engine.tensor_parallel_size)
        # How the actor and its engine processes log (services/observability/logs.py).
        options = replace(options, env=tuple(quiet_env(self.stack.log_level).items()))
        return ActorSpec(options, args)

    def _server(self, role: str, first: bool) -> ServerConfig:
        s = self.stack
        if first:
            server = s.server.model_copy()
        else:
            server = s.server.model_copy(update={"port": 0, "metrics_port": -1, "http_port": 0,
                                                 "health_port": 0})
            if self.local_cluster:
                # Internal ports of a local stack are for this machine only.
                server = server.model_copy(update={"host": LOOPBACK})
        if self.tls is not None:
            server = server.model_copy(update=self.tls.settings(role))
        return server

    def router(self, index: int) -> RouterArgs:
        s = self.stack
        update = {"redis_url": self.redis_url,
                  # The tokenizer of the model the workers serve, unless told another.
                  "router_model": s.router.router_model or s.engine.model}
        if s.launcher.models:
            # Every model by name with its tokenizer's folder, the default first.
            folders = [(default_served_name(s.engine), str(default_folder(s.engine))),
                       *((m.served_name, m.model) for m in s.launcher.models)]
            update["router_models"] = ",".join(f"{n}={f}" for n, f in folders)
        router = s.router.model_copy(update=update)
        return RouterArgs(self._server("router", first=index == 0), router, self.secret)

    def worker(self, role: str, index: int) -> WorkerArgs:
        """Worker `index` of the pool `role` (`Pool`)."""
        lc = self.stack.launcher
        pool = Pool.parse(role)
        cores = dict(zip(ROLES, split_cores(lc.prefill_cores, lc.decode_cores),
                         strict=True))[pool.role]
        if pool.model == 0:
            engine = role_engine(lc, self.stack.engine, pool.role, cores)
        else:
            entry = lc.models[pool.model - 1]
            engine = role_engine(lc, entry.engine(self.stack.engine), pool.role, cores)
            if entry.tp:  # the model's own size wins over the stack's per-role one
                engine = engine.model_copy(update={"tensor_parallel_size": entry.tp})
        update: dict[str, Any] = {"redis_url": self.redis_url, "worker_id": f"{role}-{index}"}
        if self.local_cluster:
            update["kv_host"] = LOOPBACK
        worker = self.stack.worker.model_copy(update=update)
        return WorkerArgs(pool.role, self._server(pool.role, first=False), engine, worker,
                          advertise_node_ip=not self.local_cluster, secret=self.secret)
