"""`pdserve down` waits until the stack it stopped is gone.

`pdserve down` writes `down` into the stack's desired state (`scale.set_desired`); the
launcher then drains and ends its actors, shuts Ray down, deletes the desired state and,
last, removes the local stack's descriptor (`services/registry/local_stack.py`). So:

- a local stack is down when its descriptor is gone;
- a stack reached through `--redis-url` is down when its desired state is gone from that
  Redis (or that Redis no longer answers: the launcher stopped its own redis-server).
"""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import RedisError

from services.launcher.desired import DESIRED_KEY
from services.registry.local_stack import read_state, state_path
from services.registry.registry import redis_client
from services.security.redaction import redact_url

POLL_S = 0.5


class StillRunning(RuntimeError):
    """The stack did not stop within the timeout; the message says what to do."""


async def _state_gone(redis_url: str) -> bool:
    redis = redis_client(redis_url, timeout_s=2.0)
    try:
        return not await redis.exists(DESIRED_KEY)
    except (RedisError, OSError):
        return True  # the launcher's own redis-server stops with the stack
    finally:
        await redis.aclose()


async def wait_down(redis_url: str, timeout_s: float) -> float:
    """Wait until the stack that `redis_url` ("" = the local stack) names is down; the
    seconds it took. StillRunning after `timeout_s`."""
    local = read_state()
    path = state_path()
    is_local = local is not None and redis_url in ("", local.redis_url)
    started = time.monotonic()
    while True:
        if is_local:
            if not path.exists():
                return time.monotonic() - started
        elif await _state_gone(redis_url):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            where = (
                f"its state file {path} is still there"
                if is_local
                else f"its desired state is still in {redact_url(redis_url)}"
            )
            raise StillRunning(
                f"the stack is still stopping after {timeout_s:.0f} s ({where}): its "
                "workers may still be draining long streams (--grace-s). Wait longer with "
                "`pdserve down --timeout SECONDS`, or look at `pdserve up`'s output"
            )
        await asyncio.sleep(POLL_S)
