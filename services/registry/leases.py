"""Per-client concurrency as leases that expire when the router holding them dies.

Each client has one sorted set in Redis, lease id -> expiry (ms, Redis's own clock, so
routers on machines with skewed clocks agree). A router acquires a lease per request
while fewer than `limit` unexpired ones exist, renews the leases it holds every third
of their TTL while their requests run, and removes each when its request ends. A
router that crashes stops renewing, and its leases lapse within one TTL: the client's
slots come back without anyone cleaning up.

While Redis does not answer, a router grants leases on its own count alone (the limit
then holds per router, not across them), so a partition from Redis costs the limit's
precision for a while, never the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

LOCAL_LEASES = Counter("pdserve_router_client_leases_local",
                       "client leases this router granted on its own count because Redis "
                       "did not answer")
LOG_EVERY_S = 30.0

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
"""
_EXPIRE_WITH_LAST = """
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then redis.call('PEXPIREAT', KEYS[1], last[2]) end
"""
# KEYS[1] the client's set; ARGV: limit, ttl ms, lease id. 1 = acquired.
ACQUIRE = _NOW + """
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
""" + _EXPIRE_WITH_LAST + "return 1"
# KEYS[1] the client's set; ARGV: ttl ms, lease ids. Only leases still there are
# renewed (XX): one that lapsed, or was lost with a Redis restart, is not re-created
# behind the limit's back. Returns how many were renewed.
RENEW = _NOW + """
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[1]), ARGV[i])
end
""" + _EXPIRE_WITH_LAST + "return n"


@dataclass(frozen=True, slots=True)
class Lease:
    client_id: str
    lease_id: str
    local: bool = False  # granted on this router's own count: Redis did not answer


class ClientLeases:
    """The leases one router holds, renewed in the background while held.

        lease = await leases.acquire(client_id, limit)   # None: the client is at its limit
        try: ... serve ...
        finally: await leases.release(lease)
    """

    def __init__(self, redis: Any, key_prefix: str, ttl_s: float = 15.0) -> None:
        self.redis = redis
        self.key_prefix = key_prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._acquire = redis.register_script(ACQUIRE)
        self._renew = redis.register_script(RENEW)
        self._held: dict[str, set[str]] = defaultdict(set)
        self._renewer: asyncio.Task[None] | None = None
        self._warned = -LOG_EVERY_S  # loop time of the last "Redis did not answer"

    def _key(self, client_id: str) -> str:
        return f"{self.key_prefix}{client_id}"

    async def acquire(self, client_id: str, limit: int) -> Lease | None:
        lease = Lease(client_id, uuid.uuid4().hex)
        try:
            got = await self._acquire(keys=[self._key(client_id)],
                                      args=[limit, self.ttl_ms, lease.lease_id])
        except (TimeoutError, RedisError, OSError) as e:
            return self._acquire_here(lease, limit, e)
        if not int(got):
            return None
        self._held[client_id].add(lease.lease_id)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_forever())
        return lease

    def _acquire_here(self, lease: Lease, limit: int, error: BaseException) -> Lease | None:
        """Redis did not answer: the client's slots as this router counts them."""
        now = asyncio.get_running_loop().time()
        if now - self._warned >= LOG_EVERY_S:
            self._warned = now
            log.warning("client leases: Redis did not answer (%s); admitting on this "
                        "router's own count until it does", error)
        if self.held(lease.client_id) >= limit:
            return None
        LOCAL_LEASES.inc()
        lease = Lease(lease.client_id, lease.lease_id, local=True)
        self._held[lease.client_id].add(lease.lease_id)
        return lease

    async def release(self, lease: Lease) -> None:
        held = self._held.get(lease.client_id)
        if held is not None:
            held.discard(lease.lease_id)
            if not held:
                del self._held[lease.client_id]
        if not lease.local:  # a local lease never reached Redis
            await self.redis.zrem(self._key(lease.client_id), lease.lease_id)

    def held(self, client_id: str) -> int:
        return len(self._held.get(client_id, ()))

    async def renew(self) -> int:
        """Push the expiry of every held lease one TTL ahead; how many were renewed."""
        clients = {c: sorted(ids) for c, ids in self._held.items() if ids}
        counts = await asyncio.gather(*(
            self._renew(keys=[self._key(c)], args=[self.ttl_ms, *ids])
            for c, ids in clients.items()))
        return sum(int(n) for n in counts)

    async def _renew_forever(self) -> None:
        failing = False
        while self._held:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                await self.renew()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: the leases may lapse; serving goes on
                if not failing:
                    log.warning("renewing client leases failed (%s); retrying", e)
                failing = True

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._renewer
