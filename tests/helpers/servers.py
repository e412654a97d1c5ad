"""Start real pdserve processes for tests: `pdserve serve` as a child process on
loopback ports, stopped with SIGTERM (then SIGKILL) of its whole process group."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from services.bench.procstats import scrape
from services.server.channels import free_port


@dataclass
class ServerProcess:
    args: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    # Every test server also serves the OpenAI-compatible HTTP API (0 = off).
    http_port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    command: str = "serve"  # or prefill, decode, router

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API's base URL (with `/v1`, as the openai client wants)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "services.cli", self.command, *self.args,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), "--http-port", str(self.http_port)]
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **self.env})

    async def wait_ready(self, timeout: float = 300.0) -> None:
        from services.api.client import PdserveClient

        deadline = time.monotonic() + timeout
        async with PdserveClient(self.target) as client:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    raise RuntimeError(f"server exited ({code}):\n{self.log_tail(200)}")
                try:
                    if await client.health(timeout=1.0) == "SERVING":
                        return
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server not ready:\n{self.log_tail()}")
                await asyncio.sleep(0.5)

    @asynccontextmanager
    async def running(self, timeout: float = 300.0) -> AsyncIterator[ServerProcess]:
        """Started and ready for the block; stopped after it, whatever happened."""
        self.start()
        try:
            await self.wait_ready(timeout=timeout)
            yield self
        finally:
            self.stop()

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name (labels dropped; first sample wins)."""
        return scrape(self.metrics_port)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM a server started in its own session, then SIGKILL what is left."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()




@dataclass
class DisaggStack:
    """`pdserve serve --mode disagg` with its two workers on known ports."""

    server: ServerProcess
    prefill_port: int = field(default_factory=free_port)
    decode_port: int = field(default_factory=free_port)
    prefill_metrics: int = field(default_factory=free_port)
    decode_metrics: int = field(default_factory=free_port)

    @classmethod
    def create(cls, log_path: Path, transport: str, *extra: str) -> DisaggStack:
        stack = cls(ServerProcess([], log_path))
        stack.server.args = [
            "--mode", "disagg", "--kv-transport", transport, "--kv-cache-gib", "1",
            "--allow-fault-injection",
            "--prefill-port", str(stack.prefill_port), "--decode-port", str(stack.decode_port),
            "--prefill-metrics-port", str(stack.prefill_metrics),
            "--decode-metrics-port", str(stack.decode_metrics), *extra,
        ]
        return stack

    @property
    def prefill_target(self) -> str:
        return f"127.0.0.1:{self.prefill_port}"

    @property
    def decode_target(self) -> str:
        return f"127.0.0.1:{self.decode_port}"
