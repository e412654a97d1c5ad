"""Cluster state in Redis, shared by every router replica: worker registrations with
TTL heartbeats, the prefix-cache index, and per-client leases.

Keys (prefix `pdserve:` by default):
  w:<worker id>         the worker's record (JSON with an HMAC under the cluster secret),
                        expiring `ttl_s` after its last heartbeat
  workers               set of registered worker ids (pruned as records expire)
  prefix:<block hash>   hash worker id -> time.time(): who prefilled a prompt with that block
  lease:<client id>     sorted set lease id -> expiry: a client's requests in flight across
                        all routers (`leases.py`)

Redis is kept off the per-token path: it sees a heartbeat per worker per interval, a
prefix lookup per request and a lease per request, never tokens.

Reading is tolerant: a record that is not a worker (bad JSON, wrong types, no valid
HMAC) is skipped, logged once per worker id and counted in
`pdserve_registry_bad_records_total{reason}`; the other workers are served as usual.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.exceptions import ResponseError

from services.registry.leases import ClientLeases, Lease
from services.registry.records import BadRecord, WorkerRecord
from services.registry.signing import RecordSigner, signer_from_env

log = logging.getLogger(__name__)

BAD_RECORDS = Counter("pdserve_registry_bad_records", "cluster records skipped by a reader, "
                      "by reason (json, schema, signature, stale); each bad value once",
                      ["reason"])
WORKER_KIND = "worker"
_WORKER_SET = "<the worker set>"  # log-once entry of a `workers` key of the wrong type
_MAX_BAD_TRACKED = 10_000  # worker ids remembered for log-once (a flood is not a leak)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def redis_client(url: str, timeout_s: float = 1.0) -> aioredis.Redis:
    """An asyncio client for `url` (redis:// or rediss:// for TLS, password in the URL;
    TLS options such as ssl_ca_certs as URL query parameters). Short timeouts: a lost
    Redis must show up as an error within a second, not hang a heartbeat or a routing
    decision."""
    return aioredis.Redis.from_url(url, socket_timeout=timeout_s,
                                   socket_connect_timeout=timeout_s)


class Registry:
    def __init__(self, client: aioredis.Redis, ttl_s: float = 3.0, prefix: str = "pdserve:",
                 prefix_ttl_s: float = 600.0, signer: RecordSigner | None = None,
                 client_lease_s: float = 15.0, max_record_age_s: float = 300.0) -> None:
        self.redis = client
        self.ttl_ms = int(ttl_s * 1000)
        self.ns = prefix
        self.prefix_ttl_s = prefix_ttl_s
        self.signer = signer if signer is not None else signer_from_env()
        # Signed records older (or newer) than this are replays, not heartbeats.
        self.max_record_age_s = max_record_age_s
        self.leases = ClientLeases(client, f"{prefix}lease:", client_lease_s)
        self._bad: dict[str, str] = {}  # worker id -> digest of its bad value, reported

    @classmethod
    def from_url(cls, url: str, signer: RecordSigner | None = None,
                 **kwargs: float) -> Registry:
        """A registry on `url`. Without `signer`, the cluster secret comes from
        PDSERVE_CLUSTER_SECRET(_FILE), unsigned if neither is set."""
        return cls(redis_client(url), signer=signer, **kwargs)  # type: ignore[arg-type]

    async def close(self) -> None:
        await self.leases.close()
        await self.redis.aclose()

    # -- workers ----------------------------------------------------------------------
    async def heartbeat(self, record: WorkerRecord) -> None:
        """Register or refresh a worker (its record carries the latest load), signed
        under the cluster secret."""
        value = self.signer.seal(WORKER_KIND, record.to_dict())
        try:
            await self._register(record.worker_id, value)
        except ResponseError:
            # `workers` overwritten with another type (WRONGTYPE): put the set back.
            log.warning("the registry's worker set was not a set; re-creating it")
            await self.redis.delete(f"{self.ns}workers")
            await self._register(record.worker_id, value)

    async def _register(self, worker_id: str, value: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{self.ns}w:{worker_id}", value, px=self.ttl_ms)
            pipe.sadd(f"{self.ns}workers", worker_id)
            await pipe.execute()

    async def deregister(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(f"{self.ns}w:{worker_id}")
            pipe.srem(f"{self.ns}workers", worker_id)
            await pipe.execute()

    async def workers(self) -> list[WorkerRecord]:
        """Live workers: those whose last heartbeat is younger than the TTL and whose
        record is valid (bad ones are skipped, logged and counted)."""
        try:
            members = await self.redis.smembers(f"{self.ns}workers")
        except ResponseError as e:  # not a set: nobody is registered until it is one
            self._report(_WORKER_SET, BadRecord("schema", f"the worker set: {e}"), b"")
            return []
        ids = sorted(_text(x) for x in members)
        if not ids:
            return []
        values = await self.redis.mget([f"{self.ns}w:{i}" for i in ids])
        gone = [i for i, v in zip(ids, values, strict=True) if v is None]
        if gone:
            await self.redis.srem(f"{self.ns}workers", *gone)
        out: list[WorkerRecord] = []
        for worker_id, value in zip(ids, values, strict=True):
            if value is None:
                continue
            try:
                out.append(self.parse(worker_id, value))
            except BadRecord as e:
                self._report(worker_id, e, value)
            else:
                self._bad.pop(worker_id, None)
        for stale_id in set(self._bad) - set(ids) - {_WORKER_SET}:
            del self._bad[stale_id]
        return out

    def parse(self, worker_id: str, value: bytes | str) -> WorkerRecord:
        """The record stored under `w:<worker_id>`; `BadRecord` if it is not a valid,
        signed (when a secret is set), current record of that worker."""
        record = WorkerRecord.from_dict(self.signer.open(WORKER_KIND, value))
        if record.worker_id != worker_id:
            raise BadRecord("schema", f"the record names worker {record.worker_id[:40]!r}")
        if self.signer.signs and self.max_record_age_s:
            age = time.time() - record.updated
            if abs(age) > self.max_record_age_s:
                raise BadRecord("stale", f"written {age:.0f} s ago")
        return record

    def _report(self, worker_id: str, error: BadRecord, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else value
        digest = hashlib.sha256(raw).hexdigest()[:16]
        if self._bad.get(worker_id) == digest:
            return
        BAD_RECORDS.labels(error.reason).inc()
        if worker_id not in self._bad:
            log.warning("skipping the registry record of %r: %s", worker_id[:80], error)
        if len(self._bad) >= _MAX_BAD_TRACKED:
            self._bad.clear()
        self._bad[worker_id] = digest

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
    async def acquire_client_lease(self, client_id: str, limit: int) -> Lease | None:
        """A lease on one of the client's `limit` slots, renewed by this registry until
        released; None when the client is at its limit."""
        return await self.leases.acquire(client_id, limit)

    async def release_client_lease(self, lease: Lease) -> None:
        await self.leases.release(lease)

