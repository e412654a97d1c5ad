"""`pdserve demo` (what `make run` does): start a local server, stream one answer, stop."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time

from tqdm import tqdm

from services.api.client import PdserveClient
from services.server.channels import free_port

STOP_TIMEOUT_S = 120.0


async def _wait_and_ask(args: argparse.Namespace, port: int, server: subprocess.Popen[bytes],
                        log_path: str) -> int:
    async with PdserveClient(f"127.0.0.1:{port}") as client:
        started = time.monotonic()
        with tqdm(desc=f"starting the {args.mode} server (vLLM start-up takes ~30-60 s)",
                  bar_format="{desc}: {elapsed}", disable=None) as bar:
            while True:
                if server.poll() is not None:
                    print(f"\nthe server exited with {server.returncode}; its log: {log_path}",
                          file=sys.stderr)
                    return 1
                try:
                    if await client.health(timeout=1.0) == "SERVING":
                        break
                except Exception:
                    pass
                bar.update()
                await asyncio.sleep(0.5)
        info = await client.model_info()
        print(f"ready in {time.monotonic() - started:.0f} s: {info.model} "
              f"({info.serving_mode}, context {info.max_model_len})\n")
        print(f"> {args.prompt}\n")
        async for piece in client.stream(chat=[("user", args.prompt)], temperature=0.0,
                                         max_tokens=args.max_tokens):
            print(piece.text, end="", flush=True)
        print("\n")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    port = args.port or free_port()
    # The server's log goes to a file that outlives the demo, for when start-up fails.
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115
        prefix="pdserve-demo-", suffix=".log", delete=False
    )
    if args.mode == "up":  # the full stack: Ray, redis-server, router and one pair
        cmd = [sys.executable, "-m", "services.cli", "up", "--prefill", "1", "--decode", "1"]
    else:
        cmd = [sys.executable, "-m", "services.cli", "serve", "--mode", args.mode]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0"]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True, env=os.environ.copy())
    try:
        return asyncio.run(_wait_and_ask(args, port, server, log.name))
    except KeyboardInterrupt:
        return 130
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                # The stack drains its workers, then removes its Redis password, keys and
                # state file: a SIGKILL before that would leave them behind.
                server.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        print(f"(server log: {log.name})", file=sys.stderr)
