"""How a `pdserve up` stack's processes log (services/observability/logs.py)."""

from __future__ import annotations

import re

import pytest

from services.engine.config import EngineConfig
from services.launcher.actor_spec import ActorSpecs
from services.launcher.settings import LauncherConfig, Stack
from services.observability.logs import LEVEL_ENV, RAY_SKIP, driver_env, level_of, quiet_env
from services.registry.signing import SECRET_ENV
from services.router.config import RouterConfig
from services.server.settings import ServerConfig
from services.worker.config import WorkerConfig


def test_libraries_are_quiet_below_debug_and_verbose_at_debug() -> None:
    env = quiet_env("info")
    assert env[LEVEL_ENV] == "INFO" and env["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert env["PYTHONWARNINGS"] == "ignore" and env["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    debug = quiet_env("DEBUG")
    assert debug == {LEVEL_ENV: "DEBUG", "VLLM_LOGGING_LEVEL": "DEBUG"}


def test_an_unknown_level_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="use DEBUG, INFO, WARNING or ERROR"):
        level_of("loud")


def test_ray_skips_only_the_engines_import_time_noise_below_debug() -> None:
    assert driver_env("INFO") == {"RAY_DEDUP_LOGS_SKIP_REGEX": RAY_SKIP}
    assert driver_env("DEBUG") == {}
    skipped = ["Triton is installed, but doesn't include CPU backend. Disabling Triton.",
               "Loading safetensors checkpoint shards: 100% Completed | 1/1", "", "  "]
    kept = ["Traceback (most recent call last):", "RuntimeError: engine core died",
            "2026-01-01 00:00:00,000 ERROR vllm.engine: out of memory"]
    assert all(re.search(RAY_SKIP, line) for line in skipped)
    assert not any(re.search(RAY_SKIP, line) for line in kept)


def test_every_actor_gets_the_stacks_log_level_and_its_secret_outside_ray_options() -> None:
    # Ray's runtime-env agent logs the environment variables it sets up: the cluster
    # secret goes in the actor's arguments instead (never printed: repr=False).
    stack = Stack(LauncherConfig(prefill_cores="0", decode_cores="1"), EngineConfig(),
                  ServerConfig(), WorkerConfig(), RouterConfig(), log_level="INFO")
    specs = ActorSpecs(stack, "redis://127.0.0.1:1/0", secret="s3cret-0123456789")
    for role in ("prefill", "decode", "router"):
        spec = specs.spec(role, 0)
        assert spec.options.kwargs()["runtime_env"] == {"env_vars": quiet_env("INFO")}
        assert spec.args.secret == "s3cret-0123456789"
        assert "s3cret" not in repr(spec) and SECRET_ENV not in repr(spec.options.kwargs())
