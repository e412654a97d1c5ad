"""Which workers of a local `pdserve up` share CPU cores, and what the operator is told
(services/launcher/placement.py): pure placement logic, no Ray, no engines."""

from __future__ import annotations

from services.engine.config import EngineConfig
from services.launcher.placement import CoreShare, shared_cores, sharing_warning, stack_warning
from services.launcher.settings import LauncherConfig, Stack
from services.router.config import RouterConfig
from services.server.settings import ServerConfig
from services.worker.config import WorkerConfig


def test_two_prefill_workers_on_a_two_core_machine_share_core_0() -> None:
    # What `pdserve up --prefill 2 --decode 1` does on 2 cores: prefill on 0, decode on 1.
    shares = shared_cores({"prefill": 2, "decode": 1}, {"prefill": "0", "decode": "1"})
    assert shares == [CoreShare((0,), ("prefill-0", "prefill-1"))]
    text = sharing_warning(shares, [0, 1])
    assert "prefill-0 and prefill-1 share core 0" in text
    assert "Run fewer workers per role" in text and "--prefill-cores" in text
    assert "this machine has cores 0,1" in text


def test_one_worker_per_role_on_separate_cores_shares_nothing() -> None:
    assert shared_cores({"prefill": 1, "decode": 1}, {"prefill": "0-1", "decode": "2-3"}) == []
    assert sharing_warning([], [0, 1, 2, 3]) == ""


def test_overlapping_role_lists_and_groups_of_cores() -> None:
    shares = shared_cores({"prefill": 1, "decode": 2}, {"prefill": "0-2", "decode": "2-3"})
    assert shares == [CoreShare((2,), ("prefill-0", "decode-0", "decode-1")),
                      CoreShare((3,), ("decode-0", "decode-1"))]
    assert ("prefill-0, decode-0 and decode-1 share core 2; decode-0 and decode-1 share "
            "core 3") in sharing_warning(shares, [0, 1, 2, 3])


def test_gpu_roles_and_joined_clusters_are_not_warned_about() -> None:
    def stack(**launcher: str) -> Stack:
        return Stack(LauncherConfig(prefill_cores="0", decode_cores="1", **launcher),
                     EngineConfig(), ServerConfig(), WorkerConfig(), RouterConfig())

    assert "prefill-0 and prefill-1" in stack_warning(stack(), 2, 1)
    assert stack_warning(stack(), 1, 1) == ""
    assert stack_warning(stack(prefill_accelerator="H100"), 2, 1) == ""
    assert stack_warning(stack(ray_address="auto"), 2, 1) == ""
