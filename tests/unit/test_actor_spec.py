"""How `pdserve up` makes each actor (Ray options and constructor arguments), and the
local stack's descriptor file: plain objects, no Ray, no Redis."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.config import EngineConfig
from services.launcher.actor_spec import ActorSpecs, RayOptions, RouterArgs, WorkerArgs
from services.launcher.settings import LOOPBACK, LauncherConfig, Stack
from services.registry.local_stack import (
    STATE_FILE_ENV,
    LocalStack,
    read_state,
    remove_state,
    write_state,
)
from services.router.config import RouterConfig
from services.server.settings import ServerConfig
from services.worker.config import WorkerConfig


def stack(**launcher: str) -> Stack:
    return Stack(LauncherConfig(prefill_cores="0", decode_cores="1", **launcher),
                 EngineConfig(), ServerConfig(port=7000, host="0.0.0.0"), WorkerConfig(),
                 RouterConfig())


def test_ray_options_place_each_role_on_its_resource() -> None:
    cpu = RayOptions.of(LauncherConfig(), "decode", "decode-1").kwargs()
    assert cpu["name"] == "decode-1" and cpu["namespace"] == "pdserve"
    assert cpu["resources"] == {"pdserve_decode": 1} and cpu["num_cpus"] == 0
    assert "runtime_env" not in cpu and "num_gpus" not in cpu
    gpu = RayOptions.of(LauncherConfig(prefill_accelerator="H100"), "prefill",
                        "prefill-0").kwargs()
    assert (gpu["num_gpus"], gpu["accelerator_type"]) == (1, "H100")
    router = RayOptions.of(LauncherConfig(prefill_accelerator="H100"), "router",
                           "router-0").kwargs()
    assert router["resources"] == {"pdserve_router": 1} and router["num_cpus"] == 0


def test_only_the_first_router_keeps_the_configured_ports() -> None:
    specs = ActorSpecs(stack(), "redis://127.0.0.1:1/0", secret="")
    first, second = specs.spec("router", 0), specs.spec("router", 1)
    assert isinstance(first.args, RouterArgs) and isinstance(second.args, RouterArgs)
    assert (first.args.server.port, first.args.server.host) == (7000, "0.0.0.0")
    assert (second.args.server.port, second.args.server.metrics_port) == (0, -1)
    assert second.args.server.host == LOOPBACK
    assert first.args.router.redis_url == "redis://127.0.0.1:1/0"
    assert first.options.name == "router-0" and first.args.role == "router"


def test_workers_get_their_cores_free_ports_and_their_id() -> None:
    specs = ActorSpecs(stack(), "redis://127.0.0.1:1/0", secret="")
    spec = specs.spec("decode", 2)
    assert isinstance(spec.args, WorkerArgs)
    args = spec.args
    assert (args.role, args.engine.cpu_cores, args.worker.worker_id) == ("decode", "1",
                                                                          "decode-2")
    assert (args.server.port, args.server.host, args.worker.kv_host) == (0, LOOPBACK,
                                                                         LOOPBACK)
    assert not args.advertise_node_ip
    joined = ActorSpecs(stack(ray_address="auto"), "redis://r:1/0", secret="").spec(
        "prefill", 0).args
    assert isinstance(joined, WorkerArgs) and joined.advertise_node_ip
    assert joined.server.host == "0.0.0.0" and joined.engine.cpu_cores == "0"


def test_the_local_stack_descriptor_round_trips(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "up.json"
    monkeypatch.setenv(STATE_FILE_ENV, str(path))
    assert read_state() is None
    stack = LocalStack("redis://:pw@127.0.0.1:6379/0", "secret", "/certs")
    assert write_state(stack) == path
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_state() == stack
    path.write_text("[]")
    assert read_state() is None
    remove_state()
    assert not path.exists()
