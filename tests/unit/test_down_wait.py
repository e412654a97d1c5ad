"""`pdserve down` waits for a local stack's descriptor to go, and says what to do when it
does not (services/launcher/down.py; the descriptor is a plain file here, no stack)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.launcher.down import StillRunning, wait_down
from services.registry.local_stack import STATE_FILE_ENV, LocalStack, write_state


async def test_it_returns_once_the_stack_removed_its_state_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STATE_FILE_ENV, str(tmp_path / "up.json"))
    path = write_state(LocalStack("redis://:pw@127.0.0.1:1/0"))
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, path.unlink)  # what the launcher does last
    assert await wait_down("", timeout_s=60) >= 0.3


async def test_a_stack_that_does_not_stop_in_time_is_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STATE_FILE_ENV, str(tmp_path / "up.json"))
    write_state(LocalStack("redis://:pw@127.0.0.1:1/0"))
    with pytest.raises(StillRunning) as e:
        await wait_down("", timeout_s=0.2)
    assert "still stopping after 0 s" in str(e.value)
    assert "pdserve down --timeout SECONDS" in str(e.value)
