"""The launcher's watch over its desired state and its local redis-server.

Every round of the launcher's loop: a local redis-server that died is started again on
the same port with the same password, and the desired sizes are written back at once
(workers re-register with their next heartbeat; routers keep their last view meanwhile);
then the desired state is read from Redis, and one that is gone, forged, another stack's
or older than the launcher's is replaced with the launcher's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import Counter

from services.launcher.desired import Desired, DesiredState
from services.registry.records import BadRecord
from services.registry.redis_server import RedisServer
from services.registry.registry import BAD_RECORDS

log = logging.getLogger(__name__)

REDIS_RESTARTS = Counter("pdserve_supervisor_redis_restarts", "times the local "
                         "redis-server was found dead and started again")


class Watch:
    """The launcher's view of its desired state, and its local redis-server."""

    def __init__(self, state: DesiredState, desired: Desired,
                 local_redis: RedisServer | None) -> None:
        self.state = state
        self.desired = desired
        self.local_redis = local_redis
        self._complained = ""  # the last problem logged (log each once)

    def _once(self, problem: str) -> None:
        if problem != self._complained:
            log.warning("%s", problem)
            self._complained = problem

    async def keep_redis(self) -> None:
        r = self.local_redis
        if r is None or r.alive:
            return
        log.warning("the local redis-server died (exit %s); starting it again",
                    r.proc.returncode if r.proc else None)
        try:
            await asyncio.to_thread(r.start)
        except RuntimeError as e:
            self._once(f"cannot restart redis-server: {e}; retrying")
            return
        REDIS_RESTARTS.inc()
        with contextlib.suppress(Exception):
            await self.state.write(self.desired)
            log.info("redis-server is back; desired sizes written again")

    async def read(self) -> Desired:
        """The desired state to act on (the current one when Redis says nothing valid)."""
        try:
            want = await self.state.read()
        except BadRecord as e:
            BAD_RECORDS.labels(e.reason).inc()
            self._once(f"ignoring the desired state in Redis: {e}")
            want = None
        except Exception as e:  # Redis restarting: keep the pools as they are
            self._once(f"cannot read the desired sizes: {e}")
            return self.desired
        if want is not None and (want.stack != self.desired.stack
                                 or want.version < self.desired.version):
            self._once("ignoring a desired state of another stack or an older version")
            want = None
        if want is None:  # gone (Redis restarted) or not ours: put ours back
            with contextlib.suppress(Exception):
                await self.state.write(self.desired)
            return self.desired
        self._complained = ""
        self.desired = want
        return want
