"""What `pdserve top` shows: one row per registered worker, from its Redis record (role,
host, epoch, queue, running, KV usage: what it heartbeats every second) and its
Prometheus endpoint (token, transfer, error and migration counters, turned into rates
between two snapshots).

A worker whose metrics cannot be reached (a pod IP seen from a laptop) still has its
row from Redis; its rates show as unknown. `metrics_overrides` maps a worker id to a
reachable `host:port` (a `kubectl port-forward` to its pod).
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from services.registry.records import WorkerRecord
from services.registry.registry import Registry

# Counters read off each worker (summed over their labels), by the name top uses.
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "kv_bytes": "pdserve_kv_transfer_bytes_total",
    "kv_failures": "pdserve_kv_transfer_failures_total",
}
REQUEST_ERRORS = ("vllm:request_success_total", "finished_reason", "error")
MIGRATIONS = "pdserve_migrations_total"  # on routers; labelled with the worker when known
MIGRATION_WORKER_LABELS = ("worker", "from_worker")
INDEX_MODE = "pdserve_router_prefix_index_mode"  # on routers: 1 for the mode in use
ROUTED = "pdserve_router_routed_prompt_tokens_total"  # on routers, per pool
CACHED = "pdserve_router_cached_prompt_tokens_total"
SCRAPE_TIMEOUT_S = 0.8  # below the 1 s refresh: a slow endpoint never stalls the view


def parse_metrics(text: str) -> dict[str, float]:
    """The counters top uses from one Prometheus text page (absent ones left out)."""
    wanted = {v: k for k, v in COUNTERS.items()}
    out: dict[str, float] = {}
    name, label, value = REQUEST_ERRORS
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                key = wanted[s.name]
                out[key] = out.get(key, 0.0) + s.value
            elif s.name == name and s.labels.get(label) == value:
                out["request_errors"] = out.get("request_errors", 0.0) + s.value
    return out


def parse_migrations(text: str) -> tuple[float, dict[str, float]]:
    """A router page's migrations: the total, and per worker where a label names it."""
    total, per_worker = 0.0, dict[str, float]()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name != MIGRATIONS:
                continue
            total += s.value
            for label in MIGRATION_WORKER_LABELS:
                if worker := s.labels.get(label):
                    per_worker[worker] = per_worker.get(worker, 0.0) + s.value
                    break
    return total, per_worker


@dataclass(frozen=True)
class PrefixIndex:
    """A router's prefix index: which one it routes on, and the share of the prompt
    tokens it routed to each pool that the chosen worker had cached (since the router
    started; a pool absent: nothing routed there with its cache known)."""

    mode: str  # precise, approximate or mixed ("" = the router does not say)
    hit_rate: dict[str, float] = field(default_factory=dict)  # pool -> 0..1


def parse_prefix_index(text: str) -> PrefixIndex:
    """The prefix index figures of one router page."""
    mode = ""
    routed: dict[str, float] = {}
    cached: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == INDEX_MODE and s.value == 1:
                mode = s.labels.get("mode", "")
            elif s.name in (ROUTED, CACHED):
                into = routed if s.name == ROUTED else cached
                pool = s.labels.get("pool", "")
                into[pool] = into.get(pool, 0.0) + s.value
    rates = {pool: cached.get(pool, 0.0) / n for pool, n in sorted(routed.items()) if n > 0}
    return PrefixIndex(mode, rates)


def fetch(address: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> str | None:
    """GET http://address/metrics; None when it cannot be read."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as r:
            return str(r.read().decode())
    except (OSError, ValueError):
        return None


def metrics_address(record: WorkerRecord, overrides: Mapping[str, str]) -> str:
    """Where this worker's metrics are read: the override, else what it registered."""
    return overrides.get(record.worker_id) or record.metrics_target


def started_age_s(epoch: int, wall: float) -> float | None:
    """Seconds since a worker started, from its restart epoch (time.time_ns() at start);
    None for an epoch that is no such time (an older or foreign writer)."""
    if epoch < 10**18:  # before 2001 in nanoseconds: a counter, not a start time
        return None
    return max(0.0, wall - epoch / 1e9)


@dataclass(frozen=True)
class Scrape:
    """One worker at one instant."""

    record: WorkerRecord
    address: str  # where the metrics were read ("" = nowhere)
    at: float  # time.monotonic()
    counters: dict[str, float] | None  # None: metrics not reachable


@dataclass
class Row:
    worker_id: str
    role: str
    host: str
    address: str
    epoch: int  # restart epoch, as registered (time.time_ns() at the worker's start)
    started_age_s: float | None  # seconds since that start (None: epoch is no time)
    metrics_address: str  # where its metrics were read ("" = none registered)
    queue: int  # requests waiting in the engine
    running: int
    capacity: int
    kv_usage: float  # 0..1
    heartbeat_age_s: float
    metrics: bool  # the metrics endpoint answered
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    kv_gbytes_per_s: float | None = None  # KV received (decode workers)
    errors: int | None = None  # failed KV transfers + requests vLLM ended with an error
    migrations: int | None = None  # streams moved off this worker (from router metrics)
    tp: int = 1  # tensor-parallel size, as registered
    kv_events: bool = False  # publishes its KV cache events (the precise prefix index)
    model: str = ""  # the served model's name, as registered


@dataclass
class Snapshot:
    rows: list[Row]
    routers: dict[str, float | None] = field(default_factory=dict)  # address -> migrations
    taken_at: float = field(default_factory=time.time)
    # address -> the router's prefix index (None: its metrics not reachable)
    prefix_index: dict[str, PrefixIndex | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "taken_at": self.taken_at,
            "workers": [asdict(r) for r in self.rows],
            "router_migrations": self.routers,
            "router_prefix_index": {a: None if i is None else asdict(i)
                                    for a, i in self.prefix_index.items()},
        }


def _rate(now: Scrape, before: Scrape | None, key: str, scale: float = 1.0) -> float | None:
    if (
        before is None
        or now.counters is None
        or before.counters is None
        or before.record.epoch != now.record.epoch
        or key not in now.counters
    ):
        return None
    elapsed = now.at - before.at
    delta = now.counters[key] - before.counters.get(key, 0.0)
    if elapsed <= 0 or delta < 0:  # no time passed, or the counter restarted
        return None
    return delta / elapsed / scale


def make_row(
    now: Scrape, before: Scrape | None, migrations: Mapping[str, float] | None, wall: float
) -> Row:
    """`migrations`: per worker, from the routers' pages (None: no router was read)."""
    r, c = now.record, now.counters
    row = Row(
        r.worker_id,
        r.role,
        r.host,
        r.address,
        r.epoch,
        started_age_s(r.epoch, wall),
        now.address,
        r.load.waiting,
        r.load.running,
        r.capacity,
        r.load.kv_usage,
        max(0.0, wall - r.updated),
        c is not None,
        tp=r.tp,
        kv_events=r.kv_events,
        model=r.model,
    )
    row.prompt_tokens_per_s = _rate(now, before, "prompt_tokens")
    row.generation_tokens_per_s = _rate(now, before, "generation_tokens")
    row.kv_gbytes_per_s = _rate(now, before, "kv_bytes", 1e9)
    if c is not None:
        row.errors = int(c.get("kv_failures", 0.0) + c.get("request_errors", 0.0))
    if migrations is not None:  # some router's metrics were read
        row.migrations = int(migrations.get(r.worker_id, 0.0))
    return row


class Fleet:
    """Takes snapshots of a running stack; keeps the previous scrape for rates."""

    def __init__(
        self,
        registry: Registry,
        metrics_overrides: Mapping[str, str] | None = None,
        routers: Iterable[str] = (),
    ) -> None:
        self.registry = registry
        self.overrides = dict(metrics_overrides or {})
        self.routers = list(routers)
        self._last: dict[str, Scrape] = {}
        self._prefix_index: dict[str, PrefixIndex | None] = {}

    async def _scrape(self, record: WorkerRecord) -> Scrape:
        address = metrics_address(record, self.overrides)
        text = await asyncio.to_thread(fetch, address) if address else None
        return Scrape(
            record, address, time.monotonic(), None if text is None else parse_metrics(text)
        )

    async def _router_migrations(self) -> tuple[dict[str, float | None], dict[str, float]]:
        pages = await asyncio.gather(*(asyncio.to_thread(fetch, a) for a in self.routers))
        totals: dict[str, float | None] = {}
        per_worker: dict[str, float] = {}
        self._prefix_index = {}
        for address, text in zip(self.routers, pages, strict=True):
            if text is None:
                totals[address] = None
                self._prefix_index[address] = None
                continue
            self._prefix_index[address] = parse_prefix_index(text)
            totals[address], mine = parse_migrations(text)
            for worker, n in mine.items():
                per_worker[worker] = per_worker.get(worker, 0.0) + n
        return totals, per_worker

    async def snapshot(self) -> Snapshot:
        records = await self.registry.workers()
        scrapes, (totals, migrations) = await asyncio.gather(
            asyncio.gather(*(self._scrape(r) for r in records)), self._router_migrations()
        )
        wall = time.time()
        known = migrations if any(v is not None for v in totals.values()) else None
        rows = [make_row(s, self._last.get(s.record.worker_id), known, wall) for s in scrapes]
        self._last = {s.record.worker_id: s for s in scrapes}
        rows.sort(key=lambda row: (row.role != "prefill", row.worker_id))
        return Snapshot(rows, totals, wall, dict(self._prefix_index))
