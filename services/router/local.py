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

from pydantic_settings import BaseSettings

from services.api.server import ServerConfig, generation_service, serve
from services.engine.config import EngineConfig, available_cores, format_cores
from services.engine.model import resolve_model
from services.router.orchestrator import DisaggBackend
from services.settings import add_arguments, env_name, from_arguments
from services.workers import WorkerConfig, free_port

log = logging.getLogger(__name__)
ERROR_LINE = re.compile(r"\b\w*(Error|Exception): ")


def tokens(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a token count must be >= 0, got {value}")
    return value


def add_disagg_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, WorkerConfig)
    g = parser.add_argument_group("local disaggregated pair (--mode disagg)")
    g.add_argument("--prefill-cores", default="",
                   help="cores of the prefill worker; default: the first half of the cores")
    g.add_argument("--decode-cores", default="",
                   help="cores of the decode worker; default: the second half of the cores")
    g.add_argument("--local-prefill-max-tokens", type=tokens, default=0,
                   help="prompts up to this many tokens prefill on the decode worker "
                   "instead of being shipped (0 = always disaggregate)")
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


async def wait_healthy(worker: LocalWorker, timeout: float = 600.0) -> None:
    from services.api.client import PdserveClient

    deadline = time.monotonic() + timeout
    async with PdserveClient(worker.target) as client:
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
    backend = DisaggBackend(AutoTokenizer.from_pretrained(str(model_path)), str(model_path),
                            args.local_prefill_max_tokens)
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
