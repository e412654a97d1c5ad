"""`pdserve scale` and `pdserve down`: change a running stack's desired state.

The stack is found through `--redis-url`, else the local stack's descriptor
(`services/registry/local_stack.py`); the document is signed under the cluster secret
from the environment or `--cluster-secret-file`, else the local stack's own.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from redis.exceptions import AuthenticationError, RedisError

from services.launcher.desired import DesiredState
from services.registry.local_stack import read_state, state_path
from services.registry.records import BadRecord
from services.registry.registry import redis_client
from services.registry.signing import SECRET_ENV, SECRET_FILE_ENV, RecordSigner, load_secret
from services.security.redaction import redact_url


class LauncherError(RuntimeError):
    """A failure of `scale` or `down` the user can act on; its message is one line."""


def _target(redis_url: str, secret_file: str) -> tuple[str, RecordSigner]:
    local = read_state()
    url = redis_url or (local.redis_url if local else "")
    if not url:
        raise LauncherError(f"no local pdserve stack found ({state_path()}); pass "
                            "--redis-url")
    try:
        key = load_secret(os.environ.get(SECRET_ENV, ""),
                          secret_file or os.environ.get(SECRET_FILE_ENV, ""))
    except (OSError, ValueError) as e:
        raise LauncherError(f"cannot read the cluster secret: {e}") from None
    if key is None and local is not None and local.cluster_secret and url == local.redis_url:
        key = local.cluster_secret.encode()
    return url, RecordSigner(key)


async def set_desired(redis_url: str, update: dict[str, Any], secret_file: str = "",
                      wait_s: float = 5.0) -> dict[str, Any]:
    """Change a running stack's desired state (`update`: prefill, decode, down) and
    return it. Waits up to `wait_s` for a Redis that is restarting, or for the
    launcher to put its state back after one; LauncherError with one line otherwise."""
    url, signer = _target(redis_url, secret_file)
    try:
        redis = redis_client(url, timeout_s=2.0)
    except ValueError as e:
        raise LauncherError(f"not a Redis URL: {redact_url(url)} ({e})") from None
    state = DesiredState(redis, signer)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                current = await state.read()
                if current is not None:
                    want = current.updated(**update)
                    await state.write(want)
                    return {**want.sizes(), "down": want.down}
                problem = (f"no pdserve stack's state in the Redis at {redact_url(url)}: start one "
                           "with `pdserve up` (after a Redis restart it is back within seconds)")
            except AuthenticationError:
                raise LauncherError(f"the Redis at {redact_url(url)} refused the password: pass "
                                    "the stack's --redis-url with its password") from None
            except BadRecord as e:
                if e.reason == "signature" and not signer.signs:
                    raise LauncherError(
                        "the stack signs its state: give its secret in "
                        f"{SECRET_ENV} or --cluster-secret-file") from None
                raise LauncherError(f"the stack's state in {redact_url(url)} is not valid ({e}): "
                                    "is the cluster secret the stack's?") from None
            except (RedisError, OSError) as e:
                problem = (f"cannot reach the stack's Redis at {redact_url(url)} "
                           f"({type(e).__name__}); if `pdserve up` runs, it restarts its "
                           "redis-server within seconds: try again")
            if time.monotonic() > deadline:
                raise LauncherError(problem)
            await asyncio.sleep(0.5)
    finally:
        await redis.aclose()
