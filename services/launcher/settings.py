"""The settings of a `pdserve up` stack: the launcher's own (`LauncherConfig`: pool sizes,
placement, supervision, the live planner) and, with them, every service's settings the
stack's actors are made from (`Stack`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.engine.config import EngineConfig, cpu_only, with_step_bounds
from services.launcher.models import ModelPool
from services.registry.config import ClusterStateConfig
from services.router.config import RouterConfig
from services.server.settings import ServerConfig
from services.settings import ADVANCED, from_arguments
from services.worker.config import WorkerConfig

# Where a local stack's own ports listen (Ray's node address included).
LOOPBACK = "127.0.0.1"


class LauncherConfig(BaseSettings):
    """`pdserve up`: pool sizes, placement and supervision. Env prefix PDSERVE_."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    prefill: int = Field(1, ge=0, description="prefill workers")
    decode: int = Field(1, ge=1, description="decode workers")
    models: list[ModelPool] = Field(
        default_factory=list, description="more models the stack serves beside its own "
        "(--model, --prefill, --decode: the default model), each with its own prefill and "
        "decode pools; flag: --add-model model=FOLDER[,name=NAME][,prefill=N][,decode=N]"
        "[,max_model_len=N][,kv_cache_gib=N][,tp=N], repeatable; file: a list of such "
        "mappings (docs/getting-started.md, \"Several models in one stack\")")
    routers: int = Field(1, ge=1, description="router replicas (the first on --port, the "
                         "others on free ports)")
    ray_address: str = Field("", description="Ray cluster to join (e.g. ray://head:10001 or "
                             "auto); empty = start a local one")
    prefill_cores: str = Field("", description="CPU: cores prefill workers are pinned to; "
                               "default: the first half")
    decode_cores: str = Field("", description="CPU: cores decode workers are pinned to; "
                              "default: the second half")
    prefill_tp: int = Field(0, ge=0, description="tensor-parallel ranks of each prefill "
                            "worker (GPU: devices per worker; CPU: its cores split per "
                            "rank); 0 = --tensor-parallel-size")
    decode_tp: int = Field(0, ge=0, description="tensor-parallel ranks of each decode "
                           "worker; 0 = --tensor-parallel-size")
    prefill_accelerator: str = Field("", description="GPU: Ray accelerator type for prefill "
                                     "workers (compute-class, e.g. H100)")
    decode_accelerator: str = Field("", description="GPU: Ray accelerator type for decode "
                                    "workers (bandwidth-class, e.g. H200)")
    actor_probe_interval_s: float = Field(2.0, gt=0, description="seconds between health "
                                          "probes of each actor by the supervisor",
                                          json_schema_extra=ADVANCED)
    actor_probe_timeout_s: float = Field(5.0, gt=0, description="an actor's probe unanswered "
                                         "this long is a miss",
                                         json_schema_extra=ADVANCED)
    actor_probe_failures: int = Field(2, ge=1, description="misses in a row before a hung "
                                      "actor is killed and restarted",
                                      json_schema_extra=ADVANCED)
    actor_start_timeout_s: float = Field(900.0, gt=0, description="an actor not ready this "
                                         "long after a (re)start is restarted",
                                         json_schema_extra=ADVANCED)
    stack_tls: bool = Field(True, description="make a CA for this stack at start, so its "
                            "internal channels are mutual TLS (local cluster; ignored when "
                            "--internal-tls-*-file are given)")
    supervisor_metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus port of the supervisor's own counters "
        "(restarts), on loopback (0 = off)", json_schema_extra=ADVANCED)
    state_file: str = Field("", description="where `scale` and `down` find a local stack's "
                            "Redis URL and secret (mode 0600); default up.json beside the "
                            "models cache", json_schema_extra=ADVANCED)
    prometheus_sd_file: str = Field(
        "", description="Prometheus file-based service discovery: the stack's metrics "
        "endpoints (router, every worker) as file_sd_configs JSON, kept current as workers "
        "come and go; default prometheus-targets.json beside the state file")
    planner_profile: str = Field(
        "", description="GPU stacks: a `pdserve plan profile` JSON; set, the live planner "
        "moves workers between the prefill and decode pools (their total stays) to the split "
        "it predicts serves the observed traffic best (docs/planning.md, \"The live planner\")")
    planner_slo: str = Field("ttft=0.5,itl=0.05", description="the live planner's SLOs, "
                             "NAME=SECONDS,... (ttft, tpot, itl, e2e): goodput is requests/s "
                             "within all of them")
    planner_interval_s: float = Field(60.0, gt=0, description="seconds of traffic the live "
                                      "planner observes per decision",
                                      json_schema_extra=ADVANCED)
    planner_cooldown_s: float = Field(300.0, ge=0, description="at least this long between "
                                      "two changes of the split",
                                      json_schema_extra=ADVANCED)
    planner_min_prefill: int = Field(1, ge=0, description="the live planner's floor for the "
                                     "prefill pool (0 lets it choose colocated serving)",
                                     json_schema_extra=ADVANCED)
    planner_min_decode: int = Field(1, ge=1, description="the live planner's floor for the "
                                    "decode pool", json_schema_extra=ADVANCED)
    planner_margin: float = Field(0.2, ge=0, description="change the split only when the "
                                  "best one's predicted goodput beats the current one's by "
                                  "more than this share (the planner's error against real "
                                  "runs; smaller gains are noise)",
                                  json_schema_extra=ADVANCED)


def role_tp(launcher: LauncherConfig, engine: EngineConfig, role: str) -> int:
    """The tensor-parallel size of `role`'s workers: the role's own, else the engine's."""
    own = {"prefill": launcher.prefill_tp, "decode": launcher.decode_tp}.get(role, 0)
    return own or engine.tensor_parallel_size


def role_engine(launcher: LauncherConfig, engine: EngineConfig, role: str,
                cores: str) -> EngineConfig:
    """The engine settings of `role`'s workers: its cores and its tensor-parallel size."""
    return engine.model_copy(update={"cpu_cores": cores,
                                     "tensor_parallel_size": role_tp(launcher, engine, role)})


@dataclass
class Stack:
    """Everything one stack is configured with: the launcher's settings and each
    service's, from which every actor's settings are derived."""

    launcher: LauncherConfig
    engine: EngineConfig
    server: ServerConfig
    worker: WorkerConfig
    router: RouterConfig
    cluster: ClusterStateConfig = field(
        default_factory=lambda: ClusterStateConfig())  # type: ignore[call-arg]
    log_level: str = "INFO"  # `--log-level`: the launcher's, its actors' and their engines'


def stack_from_args(args: argparse.Namespace) -> Stack:
    """The stack `pdserve up` runs: its settings, engine steps bounded on a CPU host."""
    engine = with_step_bounds(from_arguments(EngineConfig, args), cpu_only())
    return Stack(from_arguments(LauncherConfig, args), engine,
                 from_arguments(ServerConfig, args), from_arguments(WorkerConfig, args),
                 from_arguments(RouterConfig, args),
                 cluster=from_arguments(ClusterStateConfig, args),
                 log_level=getattr(args, "log_level", "INFO"))
