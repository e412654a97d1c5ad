"""What the supervisor says when it retires an actor (`pdserve scale` down, `down`):
the drain's duration is the actor's server's to state (its `grace_s`), once; the
supervisor's own bound, which only stops a hung drain, is not a second number."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from services.launcher.actor_spec import ActorSpec
from services.launcher.supervisor import ProbeSettings, Supervisor, Tracked


class FakeDrainingActor:
    """A stand-in for a Ray actor handle whose drain() finishes at once (no Ray here)."""

    class _Drain:
        def __init__(self) -> None:
            self.calls = 0

        def remote(self) -> Any:
            self.calls += 1

            async def drained() -> None:
                return None

            return drained()

    def __init__(self) -> None:
        self.drain = self._Drain()


def no_spec(role: str, index: int) -> ActorSpec:
    raise AssertionError("no actor is started here")


async def test_retiring_states_no_drain_duration_of_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    supervisor = Supervisor(no_spec, ProbeSettings(), local_cluster=False, drain_timeout_s=30.0)
    actor = FakeDrainingActor()
    supervisor.actors["decode-0"] = Tracked(actor, "decode", state="serving")
    with caplog.at_level(logging.INFO, logger="services.launcher.supervisor"):
        supervisor.ensure("decode", 0)  # scaled down to none
        await supervisor.retiring["decode-0"]
    assert actor.drain.calls == 1
    lines = [r.getMessage() for r in caplog.records]
    assert "draining decode-0" in lines and "stopped decode-0" in lines
    durations = [line for line in lines if re.search(r"\d+(\.\d+)? ?s\b", line)]
    assert durations == [], durations
