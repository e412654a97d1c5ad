"""`pdserve serve --mode disagg`: one prefill and one decode worker as local child
processes, each pinned to its own cores, behind the public API of this process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from pydantic_settings import BaseSettings

from services.api.server import ServerConfig, generation_service, serve
from services.engine.config import EngineConfig, available_cores, format_cores
from services.engine.model import resolve_model
from services.router.orchestrator import DisaggBackend
from services.settings import add_arguments, env_name, from_arguments
from services.workers import WorkerConfig, free_port

log = logging.getLogger(__name__)


def add_disagg_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, WorkerConfig)
    g = parser.add_argument_group("local disaggregated pair (--mode disagg)")
    g.add_argument("--prefill-cores", default="",
                   help="cores of the prefill worker; default: the first half of the cores")
    g.add_argument("--decode-cores", default="",
                   help="cores of the decode worker; default: the second half of the cores")
    for role in ("prefill", "decode"):
        g.add_argument(f"--{role}-port", type=int, default=0,
                       help=f"gRPC port of the {role} worker (0 = a free port)")
        g.add_argument(f"--{role}-metrics-port", type=int, default=0,
                       help=f"Prometheus port of the {role} worker (0 = off)")


def settings_env(settings: BaseSettings) -> dict[str, str]:
    """The settings as PDSERVE_* variables, to hand them to a child process."""
    env = {}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        env[env_name(type(settings), name)] = str(value).lower() if isinstance(
            value, bool) else str(value)
    return env


def split_cores(prefill_cores: str = "", decode_cores: str = "") -> tuple[str, str]:
    """Cores for the prefill and decode roles: as given, else the two halves."""
    cores = available_cores()
    half = max(1, len(cores) // 2)
    prefill = prefill_cores or format_cores(cores[:half])
    decode = decode_cores or format_cores(cores[half:] or cores)
    return prefill, decode


class LocalWorker:
    def __init__(self, role: str, port: int, metrics_port: int, env: dict[str, str]) -> None:
        self.role, self.port = role, port
        cmd = [sys.executable, "-m", "services.cli", role, "--host", "127.0.0.1",
               "--port", str(port), "--metrics-port", str(metrics_port)]
        # Own process group: stopping the pair stops the engines' children too.
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True)

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


async def wait_healthy(worker: LocalWorker, timeout: float = 600.0) -> None:
    from services.api.client import PdserveClient

    deadline = time.monotonic() + timeout
    async with PdserveClient(worker.target) as client:
        while True:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"the {worker.role} worker exited ({worker.proc.returncode})")
            with contextlib.suppress(Exception):
                if await client.health(timeout=1.0) == "SERVING":
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {worker.role} worker did not start in {timeout:.0f} s")
            await asyncio.sleep(0.5)


async def serve_disaggregated(engine_cfg: EngineConfig, server_cfg: ServerConfig,
                              args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    worker_cfg = from_arguments(WorkerConfig, args)
    model_path = resolve_model(engine_cfg.model, engine_cfg.resolved_dtype())
    prefill_cores, decode_cores = split_cores(args.prefill_cores, args.decode_cores)
    base: dict[str, Any] = {**settings_env(engine_cfg), **settings_env(worker_cfg)}
    workers = [
        LocalWorker(role, getattr(args, f"{role}_port") or free_port(),
                    getattr(args, f"{role}_metrics_port"),
                    {**base, "PDSERVE_CPU_CORES": cores, "PDSERVE_WORKER_ID": f"local-{role}"})
        for role, cores in (("prefill", prefill_cores), ("decode", decode_cores))
    ]
    backend = DisaggBackend(AutoTokenizer.from_pretrained(str(model_path)), str(model_path))
    try:
        log.info("starting the prefill worker (cores %s) and the decode worker (cores %s)",
                 prefill_cores, decode_cores)
        await asyncio.gather(*(wait_healthy(w) for w in workers))
        await backend.connect(workers[0].target, workers[1].target)
        await serve(server_cfg, [generation_service(backend)],
                    f"pdserve (disaggregated) serving {backend.facts.name}",
                    http_backend=backend)
    finally:
        await backend.close()
        for w in workers:
            w.stop()
