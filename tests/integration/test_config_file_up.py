"""`pdserve up --config stack.yaml`: a real stack (local Ray, redis-server, vLLM workers)
whose settings come from a settings file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.api.client import PdserveClient
from tests.helpers.servers import free_port, stop_group
from tests.integration.test_launcher import Up

pytestmark = [pytest.mark.engine, pytest.mark.slow]


class ConfiguredUp(Up):
    """`pdserve up --config stack.yaml` with every setting in the file, none in flags."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.supervisor_port = free_port()
        self.state_file = workdir / "configured-up-state.json"
        self.log = workdir / "configured-up.log"
        self.config = workdir / "stack.yaml"
        self.config.write_text(yaml.safe_dump({
            "launcher": {"prefill": 1, "decode": 1, "state_file": str(self.state_file),
                         "supervisor_metrics_port": self.supervisor_port},
            "server": {"port": self.port, "metrics_port": self.metrics_port},
            "engine": {"max_model_len": 1024, "kv_cache_gib": 1},
            "worker": {"worker_ttl_s": 3},
        }))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--config", str(self.config)],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
            env=self.env)
        # `scale` and `down` find the stack where the file put its state.
        self.env["PDSERVE_STATE_FILE"] = str(self.state_file)


async def test_up_runs_with_the_settings_of_its_config_file(
        session_dir: Path, model_path: Path) -> None:
    stack = ConfiguredUp(session_dir)
    try:
        async with PdserveClient(f"127.0.0.1:{stack.port}") as client:  # the file's port
            await client.wait_ready(timeout=900)
            info = await client.model_info()
            assert info.max_model_len == 1024  # the file's, not the default 2048
            assert info.serving_mode == "disaggregated"
            result = await client.generate(text="The capital of France is", max_tokens=3,
                                           temperature=0.0, ignore_eos=True)
        assert result.completion_tokens == 3
        assert stack.state()["redis_url"]  # written where the file said
        out = stack.pdserve("down")
        assert out.returncode == 0, out.stderr
        assert stack.proc.wait(timeout=120) == 0
    finally:
        stop_group(stack.proc, timeout=120)
