"""A `pdserve up` stack started by a benchmark: a child process in its own session, on
loopback ports, with its own state file, and the ways to look inside it.

Everything the benchmark needs to find (worker processes and epochs, the redis-server
process, the router's process) comes from the stack itself: worker records are read
through `Registry` with the stack's own cluster secret from its state file, and processes
are found in the launcher's process tree. Stopping is `pdserve down`, then SIGTERM and
SIGKILL of the process group, whatever happened before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from services.registry.records import WorkerRecord
from services.registry.registry import Registry
from services.registry.signing import RecordSigner
from services.server.channels import free_port


class UpStack:
    """`pdserve up --prefill 1 --decode 1` (sizes and extra flags configurable)."""

    def __init__(self, workdir: Path, extra_args: list[str] | None = None,
                 prefill: int = 1, decode: int = 1) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.metrics_port = free_port()
        self.state_file = workdir / "up-state.json"
        self.log_path = workdir / "up.log"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("PDSERVE_CLUSTER_SECRET")}
        self.env["PDSERVE_STATE_FILE"] = str(self.state_file)
        self.args = ["--prefill", str(prefill), "--decode", str(decode),
                     "--host", "127.0.0.1", "--port", str(self.port),
                     "--metrics-port", str(self.metrics_port), *(extra_args or [])]
        self.proc: subprocess.Popen[bytes] | None = None
        self._registry: Registry | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.state_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", *self.args],
            stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True, env=self.env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def state(self) -> dict[str, str]:
        return dict(json.loads(self.state_file.read_text()))

    async def wait_ready(self, timeout: float, workers: int = 2) -> float:
        """Seconds until the router answers SERVING and `workers` workers are registered."""
        from services.api.client import PdserveClient

        t0 = time.monotonic()
        deadline = t0 + timeout
        async with PdserveClient(self.address) as client:
            while True:
                if not self.alive():
                    raise RuntimeError(f"pdserve up exited:\n{self.log_tail()}")
                try:
                    if (self.state_file.exists()
                            and await client.health(timeout=1.0) == "SERVING"
                            and len(await self.records()) >= workers):
                        return time.monotonic() - t0
                except Exception:  # still starting: no state, no router, no Redis yet
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"pdserve up not ready in {timeout} s:\n"
                                       f"{self.log_tail()}")
                await asyncio.sleep(0.5)

    def registry(self) -> Registry:
        if self._registry is None:
            state = self.state()
            secret = state.get("cluster_secret", "")
            self._registry = Registry.from_url(
                state["redis_url"], signer=RecordSigner(secret.encode() if secret else None))
        return self._registry

    async def records(self) -> list[WorkerRecord]:
        """The live worker records (raises while Redis is away)."""
        return await self.registry().workers()

    async def redis_keys(self) -> int:
        return int(await self.registry().redis.dbsize())

    async def redis_ping(self) -> bool:
        try:
            return bool(await self.registry().redis.ping())
        except Exception:
            return False

    def tree(self) -> list[psutil.Process]:
        """The launcher and every process below it (Ray, actors, engines, redis-server)."""
        if not self.alive():
            return []
        assert self.proc is not None
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def redis_pid(self) -> int | None:
        for p in self.tree():
            try:
                if p.name() == "redis-server":
                    return p.pid
            except psutil.Error:
                continue
        return None

    def listener_pid(self, port: int) -> int | None:
        """The process of the tree listening on `port` (the router, on the public port)."""
        for p in self.tree():
            try:
                for c in p.net_connections(kind="tcp"):
                    if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
                        return p.pid
            except psutil.Error:
                continue
        return None

    async def close(self) -> None:
        """`pdserve down`, then the process group: always safe to call."""
        if self._registry is not None:
            with contextlib.suppress(Exception):
                await self._registry.close()
            self._registry = None
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                subprocess.run([sys.executable, "-m", "services.cli", "down"], env=self.env,
                               capture_output=True, timeout=60)
                self.proc.wait(timeout=90)
            except (subprocess.TimeoutExpired, OSError):
                pass
        stop_session(self.proc)


def stop_session(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL, the process group of a child started in its own session
    (whatever is left of it even after the child itself exited)."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            time.sleep(1.0)  # children of the group may still be exiting
