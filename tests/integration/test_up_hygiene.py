"""What a real `pdserve up` stack (local Ray, its own redis-server, vLLM workers) leaves
in its logs and on disk: no credential in any log it wrote, a quiet start with one
ready line, `pdserve down` returning only once the stack is gone, and none of its
temporary folders (they hold the Redis password and TLS keys) left after it stops, a
stop during start-up included.

Each stack gets a private TMPDIR: its own and Ray's temporary files (Ray's session logs
among them) land there, and every process of the stack carries it in its environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import psutil
import pytest

from services.api.client import PdserveClient
from tests.helpers.servers import stop_group
from tests.integration.test_launcher import Up

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# Third-party start-up noise that `--log-level info` must not show.
NOISE = re.compile(r"Triton|FutureWarning|DeprecationWarning|NUMA|Token authentication|"
                   r"deprecated|LD_PRELOAD|experimental", re.I)
READY = re.compile(r"^ready in \d+ s: pdserve is up, router on 127\.0\.0\.1:\d+ "
                   r"\(1 prefill, 1 decode workers; Redis redis://:\*\*\*@127\.0\.0\.1:\d+/0; "
                   r"state in .+\)$")


@pytest.fixture
def tmpdir_of_stack() -> Iterator[Path]:
    """A short private TMPDIR (Ray's socket paths must stay under the kernel's limit)."""
    path = Path(tempfile.mkdtemp(prefix="pdh-", dir="/tmp"))
    yield path
    for p in processes_of(path):  # a failed test leaves nothing running
        with contextlib.suppress(psutil.Error):
            p.kill()
    shutil.rmtree(path, ignore_errors=True)


def processes_of(tmp: Path) -> list[psutil.Process]:
    """The live processes started with TMPDIR=tmp: the launcher and everything below it
    (Ray's GCS and raylet, actors, engines, redis-server)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TMPDIR") == str(tmp) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def pdserve_temp_entries(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("pdserve-*"))


def log_files(up: Up, tmp: Path) -> list[Path]:
    """Every log the stack wrote: the launcher's output and Ray's session logs."""
    ray_logs = [p for p in (tmp / "ray").glob("session_*/logs/**/*") if p.is_file()]
    assert ray_logs, f"no Ray session logs under {tmp / 'ray'}"
    return [up.log, *ray_logs]


def secret_strings(up: Up, cluster_secret: str, api_key: str) -> dict[str, str]:
    """Each credential of the stack, by what it is; for PEM keys, each line of the body."""
    password = urlsplit(up.redis_url).password or ""
    assert len(password) >= 16
    found = {"redis password": unquote(password), "redis password (quoted)": password,
             "cluster secret": cluster_secret, "API key": api_key}
    keys = sorted(Path(up.state()["tls_dir"]).rglob("*.key"))
    assert keys, "the stack made no TLS keys"
    for key in keys:
        body = [line for line in key.read_text().splitlines() if not line.startswith("-----")]
        for i, line in enumerate(body):
            if len(line) >= 16:
                found[f"{key.name} line {i}"] = line
    return found


async def test_no_secret_in_any_log_a_quiet_start_and_down_waits(
        tmpdir_of_stack: Path, model_path: Path) -> None:
    tmp = tmpdir_of_stack
    api_key = secrets.token_urlsafe(24)  # not in pdserve's own key format: no pattern hides it
    cluster_secret = secrets.token_hex(32)
    keys_file = tmp / "api-keys"
    keys_file.write_text(f"alice:{api_key}\n")
    up = Up(tmp, "--api-keys-file", str(keys_file),
            env={"TMPDIR": str(tmp), "PDSERVE_CLUSTER_SECRET": cluster_secret})
    try:
        async with PdserveClient(f"127.0.0.1:{up.port}", api_key=api_key) as client:
            await client.wait_ready(timeout=900)
            await up.wait_until(lambda rs: len(rs) == 2, 120, "both workers to register")
            result = await client.generate(text="The capital of France is", max_tokens=2,
                                           temperature=0.0)
            assert result.completion_tokens == 2
        async with PdserveClient(f"127.0.0.1:{up.port}", api_key="wrong" + api_key) as bad:
            with pytest.raises(Exception, match="invalid API key"):
                await bad.generate(text="Hi", max_tokens=1)
        wanted = secret_strings(up, cluster_secret, api_key)
        assert pdserve_temp_entries(tmp), "the running stack's folders are not in its TMPDIR"

        out = up.pdserve("down")
        assert out.returncode == 0, out.stderr
        assert "the stack is down" in out.stdout
        # `down` returned: the stack's processes, folders and state file are gone already.
        left = processes_of(tmp)
        assert all(p.pid == up.proc.pid for p in left), [p.cmdline()[:3] for p in left]
        assert pdserve_temp_entries(tmp) == []
        assert not up.state_file.exists()
        assert up.proc.wait(timeout=30) == 0
    finally:
        stop_group(up.proc, timeout=120)

    startup = up.log.read_text(errors="replace").splitlines()
    ready = [line for line in startup if line.startswith("ready in ")]
    assert len(ready) == 1 and READY.match(ready[0]), ready
    noise = [line for line in startup if NOISE.search(line)]
    assert not noise, "\n".join(noise[:20])

    leaks = []
    for path in log_files(up, tmp):
        text = path.read_bytes().decode(errors="replace")
        leaks += [f"{what} in {path}" for what, value in wanted.items() if value in text]
    assert not leaks, "\n".join(leaks)


async def test_a_stack_stopped_while_it_starts_leaves_nothing_behind(
        tmpdir_of_stack: Path, model_path: Path) -> None:
    tmp = tmpdir_of_stack
    up = Up(tmp, env={"TMPDIR": str(tmp)})
    try:
        up.state()  # written once its Redis and certificates exist, before Ray starts
        assert pdserve_temp_entries(tmp)
        os.kill(up.proc.pid, signal.SIGTERM)  # `kill PID`: the launcher alone, not its group
        up.proc.wait(timeout=180)
        deadline = time.monotonic() + 30  # processes that were already exiting
        while processes_of(tmp) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert processes_of(tmp) == []
        assert pdserve_temp_entries(tmp) == []
        assert not up.state_file.exists()
    finally:
        stop_group(up.proc, timeout=120)
