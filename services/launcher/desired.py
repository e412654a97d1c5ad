"""The desired state of a `pdserve up` stack, kept in Redis, and the local state file.

`pdserve scale` and `pdserve down` write the desired pool sizes (or a shutdown request)
under `pdserve:desired`; the supervisor reads them every second. The document is signed
under the cluster secret and carries the stack's id and a version: the supervisor takes
only its own stack's documents, never an older version than it has (a replay), and puts
its own state back when the key is missing or forged (a Redis restart, a stray writer),
so scaling keeps working after Redis comes back.

The state file (mode 0600) tells `scale` and `down` on the same machine where the local
stack's Redis is, with its password, and the cluster secret.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from redis.exceptions import AuthenticationError, RedisError

from services.registry.records import BadRecord
from services.registry.redis_server import redact, write_private
from services.registry.registry import redis_client
from services.registry.signing import SECRET_ENV, SECRET_FILE_ENV, RecordSigner, load_secret

DESIRED_KEY = "pdserve:desired"
DESIRED_KIND = "desired"
STATE_FILE_ENV = "PDSERVE_STATE_FILE"


class LauncherError(RuntimeError):
    """A failure of `scale` or `down` the user can act on; its message is one line."""


@dataclass(frozen=True, slots=True)
class Desired:
    prefill: int
    decode: int
    routers: int = 1
    down: bool = False
    stack: str = ""  # the id of the `pdserve up` run that owns the document
    version: int = 0  # time.time_ns() of the write: newer wins

    def sizes(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode, "routers": self.routers}

    def updated(self, **changes: Any) -> Desired:
        return replace(self, version=max(time.time_ns(), self.version + 1), **changes)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Desired:
        try:
            out = cls(prefill=int(d["prefill"]), decode=int(d["decode"]),
                      routers=int(d.get("routers", 1)), down=bool(d.get("down", False)),
                      stack=str(d.get("stack", "")), version=int(d.get("version", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise BadRecord("schema", f"desired state: {e!r}") from None
        if min(out.prefill, out.decode - 1, out.routers - 1) < 0:
            raise BadRecord("schema", "desired state: a pool size out of range")
        return out


class DesiredState:
    """Reads and writes the signed desired-state document."""

    def __init__(self, redis: Any, signer: RecordSigner) -> None:
        self.redis = redis
        self.signer = signer

    async def write(self, desired: Desired) -> None:
        await self.redis.set(DESIRED_KEY, self.signer.seal(DESIRED_KIND, asdict(desired)))

    async def read(self) -> Desired | None:
        """The document; None when the key is missing; BadRecord when it is forged or
        malformed."""
        raw = await self.redis.get(DESIRED_KEY)
        if raw is None:
            return None
        return Desired.from_dict(self.signer.open(DESIRED_KIND, raw))

    async def delete(self) -> None:
        await self.redis.delete(DESIRED_KEY)


# -- the local state file ------------------------------------------------------------------
def state_path() -> Path:
    """Where `pdserve up` leaves its Redis URL and secret for `scale` and `down`:
    $PDSERVE_STATE_FILE, else up.json beside the models cache."""
    from services.engine.model import models_dir

    return Path(os.environ.get(STATE_FILE_ENV) or models_dir().parent / "up.json")


def write_state(redis_url: str, secret: str, tls_dir: str = "") -> Path:
    """Record the local stack: its Redis URL (with the password), the cluster secret and
    the folder of the stack's own certificates (`pdserve certs` layout; "" = none)."""
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps({"redis_url": redis_url, "cluster_secret": secret,
                                    "tls_dir": tls_dir}))
    return path


def read_state() -> dict[str, str]:
    try:
        state = json.loads(state_path().read_text())
        return {"redis_url": str(state["redis_url"]),
                "cluster_secret": str(state.get("cluster_secret", "")),
                "tls_dir": str(state.get("tls_dir", ""))}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def remove_state() -> None:
    state_path().unlink(missing_ok=True)


# -- `pdserve scale` / `pdserve down` --------------------------------------------------------
def _target(redis_url: str, secret_file: str) -> tuple[str, RecordSigner]:
    state = read_state()
    url = redis_url or state.get("redis_url", "")
    if not url:
        raise LauncherError(f"no local pdserve stack found ({state_path()}); pass "
                            "--redis-url")
    try:
        key = load_secret(os.environ.get(SECRET_ENV, ""),
                          secret_file or os.environ.get(SECRET_FILE_ENV, ""))
    except (OSError, ValueError) as e:
        raise LauncherError(f"cannot read the cluster secret: {e}") from None
    if key is None and state.get("cluster_secret") and url == state.get("redis_url"):
        key = state["cluster_secret"].encode()
    return url, RecordSigner(key)


async def set_desired(redis_url: str, update: dict[str, Any], secret_file: str = "",
                      wait_s: float = 5.0) -> dict[str, Any]:
    """Change a running stack's desired state (`update`: prefill, decode, down) and
    return it. Waits up to `wait_s` for a Redis that is restarting, or for the
    supervisor to put its state back after one; LauncherError with one line otherwise."""
    url, signer = _target(redis_url, secret_file)
    try:
        redis = redis_client(url, timeout_s=2.0)
    except ValueError as e:
        raise LauncherError(f"not a Redis URL: {redact(url)} ({e})") from None
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
                problem = (f"no pdserve stack's state in the Redis at {redact(url)}: start one "
                           "with `pdserve up` (after a Redis restart it is back within seconds)")
            except AuthenticationError:
                raise LauncherError(f"the Redis at {redact(url)} refused the password: pass "
                                    "the stack's --redis-url with its password") from None
            except BadRecord as e:
                if e.reason == "signature" and not signer.signs:
                    raise LauncherError(
                        "the stack signs its state: give its secret in "
                        f"{SECRET_ENV} or --cluster-secret-file") from None
                raise LauncherError(f"the stack's state in {redact(url)} is not valid ({e}): "
                                    "is the cluster secret the stack's?") from None
            except (RedisError, OSError) as e:
                problem = (f"cannot reach the stack's Redis at {redact(url)} "
                           f"({type(e).__name__}); if `pdserve up` runs, it restarts its "
                           "redis-server within seconds: try again")
            if time.monotonic() > deadline:
                raise LauncherError(problem)
            await asyncio.sleep(0.5)
    finally:
        await redis.aclose()
