"""Cluster state in Redis, shared by every router replica: worker registrations with
TTL heartbeats, the prefix-cache index, and per-client concurrency counts.

Keys (prefix `pdserve:` by default):
  w:<worker id>         the worker's record (JSON), expiring `ttl_s` after its last heartbeat
  workers               set of registered worker ids (pruned as records expire)
  prefix:<block hash>   hash worker id -> time.time(): who prefilled a prompt with that block
  client:<client id>    a client's requests in flight across all routers

Redis is kept off the per-token path: it sees a heartbeat per worker per interval, a
prefix lookup per request and a counter per request, never tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from services.registry.records import WorkerRecord


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Registry:
    def __init__(self, client: aioredis.Redis, ttl_s: float = 3.0, prefix: str = "pdserve:",
                 prefix_ttl_s: float = 600.0) -> None:
        self.redis = client
        self.ttl_ms = int(ttl_s * 1000)
        self.ns = prefix
        self.prefix_ttl_s = prefix_ttl_s

    @classmethod
    def from_url(cls, url: str, **kwargs: float) -> Registry:
        # Short timeouts: a lost Redis must show up as an error within a second, not hang
        # a heartbeat or a routing decision.
        client = aioredis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        return cls(client, **kwargs)  # type: ignore[arg-type]

    async def close(self) -> None:
        await self.redis.aclose()

    # -- workers ----------------------------------------------------------------------
    async def heartbeat(self, record: WorkerRecord) -> None:
        """Register or refresh a worker (its record carries the latest load)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{self.ns}w:{record.worker_id}", record.to_json(), px=self.ttl_ms)
            pipe.sadd(f"{self.ns}workers", record.worker_id)
            await pipe.execute()

    async def deregister(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(f"{self.ns}w:{worker_id}")
            pipe.srem(f"{self.ns}workers", worker_id)
            await pipe.execute()

    async def workers(self) -> list[WorkerRecord]:
        """Live workers: those whose last heartbeat is younger than the TTL."""
        ids = sorted(_text(x) for x in await self.redis.smembers(f"{self.ns}workers"))
        if not ids:
            return []
        values = await self.redis.mget([f"{self.ns}w:{i}" for i in ids])
        gone = [i for i, v in zip(ids, values, strict=True) if v is None]
        if gone:
            await self.redis.srem(f"{self.ns}workers", *gone)
        return [WorkerRecord.from_json(v) for v in values if v is not None]

    # -- prefix index -----------------------------------------------------------------
    async def record_prefix(self, worker_id: str, block_hashes: Sequence[str]) -> None:
        if not block_hashes:
            return
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            for h in block_hashes:
                key = f"{self.ns}prefix:{h}"
                pipe.hset(key, worker_id, now)
                pipe.expire(key, int(self.prefix_ttl_s))
            await pipe.execute()

    async def prefix_hits(self, block_hashes: Sequence[str], block_size: int) -> dict[str, int]:
        """Cached prefix length in tokens per worker: how many leading blocks of the
        prompt each worker has prefilled before (chained hashes, so a hit on block i
        implies blocks 0..i-1 match too)."""
        if not block_hashes:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for h in block_hashes:
                pipe.hkeys(f"{self.ns}prefix:{h}")
            holders = await pipe.execute()
        hits: dict[str, int] = {}
        alive: set[str] | None = None
        for i, workers in enumerate(holders):
            current = {_text(w) for w in workers}
            alive = current if alive is None else alive & current
            if not alive:
                break
            for w in alive:
                hits[w] = (i + 1) * block_size
        return hits

    # -- per-client concurrency -------------------------------------------------------
    async def acquire_client_slot(self, client_id: str, limit: int) -> bool:
        key = f"{self.ns}client:{client_id}"
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, 3600)  # a crashed router's slots do not leak forever
            count, _ = await pipe.execute()
        if int(count) > limit:
            await self.redis.decr(key)
            return False
        return True

    async def release_client_slot(self, client_id: str) -> None:
        await self.redis.decr(f"{self.ns}client:{client_id}")
