"""`pdserve serve --mode disagg`: one prefill and one decode worker as local child
processes, each pinned to its own cores, behind the public API of this process."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.api.public import serve_public
from services.engine.config import EngineConfig, split_cores
from services.engine.model import resolve_model
from services.kv.tp_layout import (
    LayoutRefused,
    check_model_shape,
    kv_workers_tp_problem,
    read_hf_config,
)
from services.launcher.placement import ranks_warning
from services.launcher.settings import LauncherConfig, role_tp
from services.observability import tracing
from services.router.config import RouterConfig
from services.router.orchestrator import check_pair
from services.router.router import RouterBackend
from services.router.view import FixedView, record_of
from services.security.policy import internal_tls
from services.security.tls import TLSFiles
from services.server.channels import dial, free_port
from services.server.settings import ServerConfig
from services.settings import ADVANCED, add_arguments, env_name, from_arguments
from services.worker.config import WorkerConfig

log = logging.getLogger(__name__)
ERROR_LINE = re.compile(r"\b\w*(Error|Exception): ")

# The router settings that apply to one local pair (no Redis, no prefix index, one
# pool each), and the placement settings `pdserve up` shares.
PAIR_ROUTER_FIELDS = ("policy", "local_prefill_max_tokens", "prefill_max_queued_tokens",
                      "max_inflight", "client_max_inflight", "retry_after_ms")
PAIR_PLACEMENT_FIELDS = ("prefill_cores", "decode_cores", "prefill_tp", "decode_tp")


class LocalPairConfig(BaseSettings):
    """`serve --mode disagg`: the local pair's own ports. Env prefix PDSERVE_."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    prefill_port: int = Field(0, ge=0, le=65535, description="gRPC port of the local "
                              "prefill worker (0 = a free port)")
    decode_port: int = Field(0, ge=0, le=65535, description="gRPC port of the local decode "
                             "worker (0 = a free port)")
    prefill_metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port of the "
                                      "local prefill worker (0 = off)",
                                      json_schema_extra=ADVANCED)
    decode_metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port of the "
                                     "local decode worker (0 = off)",
                                     json_schema_extra=ADVANCED)


def add_disagg_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, WorkerConfig)
    add_arguments(parser, RouterConfig, only=PAIR_ROUTER_FIELDS)
    add_arguments(parser, LauncherConfig, only=PAIR_PLACEMENT_FIELDS)
    add_arguments(parser, LocalPairConfig)


def internal_tls_env(server_cfg: ServerConfig) -> dict[str, str]:
    """The internal TLS settings, for the local workers (they serve with the same files)."""
    names = ("internal_tls_ca_file", "internal_tls_cert_file", "internal_tls_key_file")
    return {env_name(ServerConfig, n): getattr(server_cfg, n) for n in names}


def settings_env(settings: BaseSettings) -> dict[str, str]:
    """The settings as PDSERVE_* variables, to hand them to a child process."""
    env = {}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        env[env_name(type(settings), name)] = str(value).lower() if isinstance(
            value, bool) else str(value)
    return env


class LocalWorker:
    def __init__(self, role: str, port: int, metrics_port: int, env: dict[str, str]) -> None:
        self.role, self.port = role, port
        cmd = [sys.executable, "-m", "services.cli", role, "--host", "127.0.0.1",
               "--port", str(port), "--metrics-port", str(metrics_port)]
        # Own process group: stopping the pair stops the engines' children too.
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        # The worker's output still reaches our terminal; its last lines are also kept,
        # so a worker that dies while starting is reported with its own words.
        self.last_lines: collections.deque[str] = collections.deque(maxlen=10)
        self.error_lines: collections.deque[str] = collections.deque(maxlen=4)
        threading.Thread(target=self._forward, name=f"{role}-log", daemon=True).start()

    def _forward(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            sys.stdout.buffer.write(raw)
            sys.stdout.flush()
            line = raw.decode(errors="replace").rstrip()
            self.last_lines.append(line)
            # The root cause is usually an exception logged well before the last lines.
            if ERROR_LINE.search(line) and line not in self.error_lines:
                self.error_lines.append(line)

    def exit_report(self) -> str:
        errors = "\n  ".join(self.error_lines) or "(none logged)"
        tail = "\n  ".join(self.last_lines)
        return (f"the {self.role} worker exited ({self.proc.returncode}); its errors:\n  "
                f"{errors}\nits last lines:\n  {tail}")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


async def wait_healthy(worker: LocalWorker, tls: TLSFiles | None,
                       timeout: float = 600.0) -> None:
    from services.api.client import PdserveClient

    deadline = time.monotonic() + timeout
    async with PdserveClient(worker.target, channel=dial(worker.target, tls)) as client:
        while True:
            if worker.proc.poll() is not None:
                await asyncio.sleep(0.2)  # let the last lines through
                raise RuntimeError(worker.exit_report())
            with contextlib.suppress(Exception):
                if await client.health(timeout=1.0) == "SERVING":
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {worker.role} worker did not start in {timeout:.0f} s")
            await asyncio.sleep(0.5)


async def pair_view(prefill_target: str, decode_target: str,
                    tls: TLSFiles | None = None) -> FixedView:
    """The pair as the router sees it, from the workers' own GetWorkerInfo (dialled with
    the internal mTLS files `tls`); an incompatible pair is refused here, before anything
    is served."""
    from pdserve.v1 import worker_pb2 as wpb
    from pdserve.v1 import worker_pb2_grpc as wpb_grpc

    async with dial(prefill_target, tls) as p, dial(decode_target, tls) as d:
        request = wpb.GetWorkerInfoRequest()
        prefill = await wpb_grpc.PrefillServiceStub(p).GetWorkerInfo(request, timeout=10)
        decode = await wpb_grpc.DecodeServiceStub(d).GetWorkerInfo(request, timeout=10)
    check_pair(prefill, decode)
    return FixedView([record_of(prefill, prefill_target), record_of(decode, decode_target)])


async def serve_disaggregated(engine_cfg: EngineConfig, server_cfg: ServerConfig,
                              args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    worker_cfg = from_arguments(WorkerConfig, args)
    router_cfg = from_arguments(RouterConfig, args)
    placement = from_arguments(LauncherConfig, args)
    ports = from_arguments(LocalPairConfig, args)
    tp = {role: role_tp(placement, engine_cfg, role) for role in ("prefill", "decode")}
    problem = kv_workers_tp_problem(tp["prefill"], tp["decode"])
    if problem:
        raise LayoutRefused(problem)
    model_path = resolve_model(engine_cfg.model, engine_cfg.resolved_dtype())
    for role in ("prefill", "decode"):  # the model's heads over each pool's ranks
        try:
            check_model_shape(read_hf_config(model_path), tp[role], kv_transfer=True)
        except ValueError as e:
            raise LayoutRefused(f"{role} workers at TP {tp[role]}: {e}") from None
    prefill_cores, decode_cores = split_cores(placement.prefill_cores, placement.decode_cores)
    base: dict[str, Any] = {**settings_env(engine_cfg), **settings_env(worker_cfg),
                            **internal_tls_env(server_cfg), **tracing.settings_env(server_cfg)}
    tracing.setup_from(server_cfg, "pdserve-router", "local")
    tls = internal_tls(server_cfg)  # the pair is dialled with it
    for role, cores in (("prefill", prefill_cores), ("decode", decode_cores)):
        warning = ranks_warning(role, cores, tp[role])
        if warning:
            log.warning("%s", warning)
    workers = [
        LocalWorker(role, getattr(ports, f"{role}_port") or free_port(),
                    getattr(ports, f"{role}_metrics_port"),
                    {**base, "PDSERVE_CPU_CORES": cores, "PDSERVE_WORKER_ID": f"local-{role}",
                     "PDSERVE_TENSOR_PARALLEL_SIZE": str(tp[role])})
        for role, cores in (("prefill", prefill_cores), ("decode", decode_cores))
    ]
    backend: RouterBackend | None = None
    try:
        log.info("starting the prefill worker (cores %s, TP %d) and the decode worker "
                 "(cores %s, TP %d)", prefill_cores, tp["prefill"], decode_cores,
                 tp["decode"])
        await asyncio.gather(*(wait_healthy(w, tls) for w in workers))
        view = await pair_view(workers[0].target, workers[1].target, tls)
        backend = RouterBackend(router_cfg, view, AutoTokenizer.from_pretrained(
            str(model_path)), str(model_path), tls=tls)
        await backend.start(wait_for_workers_s=0)
        await serve_public(server_cfg, backend,
                           f"pdserve (disaggregated) serving {backend.facts.name}")
    finally:
        if backend is not None:
            await backend.close()
        for w in workers:
            w.stop()
        tracing.shutdown_tracing()
