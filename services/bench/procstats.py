"""Samples of a running stack's resources, for soak runs: per process group (launcher,
Ray, router, each worker and its engine processes, redis-server) the resident memory,
open descriptors and threads; Redis's key count; and from each worker's Prometheus port
vLLM's KV cache usage and any staged-transfer gauge the KV transport exports.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from services.bench.upstack import UpStack

KV_USAGE = "vllm:kv_cache_usage_perc"
STAGED = re.compile(r"^pdserve_kv_.*staged")


@dataclass(slots=True)
class Sample:
    t: float  # epoch seconds
    groups: dict[str, dict[str, float]] = field(default_factory=dict)  # label -> rss/fds/...
    redis_keys: int | None = None
    kv_usage: dict[str, float] = field(default_factory=dict)  # worker id -> share in use
    staged: dict[str, float] = field(default_factory=dict)  # "<worker>/<metric>" -> value


def scrape(port: int, host: str = "127.0.0.1", **labels: str) -> dict[str, float]:
    """Prometheus samples by name from host:port; with `labels`, only samples that
    carry them (other labels dropped; first sample wins)."""
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                out.setdefault(sample.name, sample.value)
    return out


def scrape_samples(port: int, host: str = "127.0.0.1") -> list[tuple[str, float]]:
    """Every sample (name, value) of a Prometheus endpoint, labels dropped."""
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    return [(s.name, float(s.value)) for fam in text_string_to_metric_families(text)
            for s in fam.samples]


def label_processes(stack: UpStack, workers: dict[int, str]) -> dict[int, str]:
    """pid -> group label for every process of the stack. `workers` maps worker pids to
    their role; the processes below a worker are its engine's."""
    tree = stack.tree()
    labels: dict[int, str] = {}
    router = stack.listener_pid(stack.port)
    assert stack.proc is not None
    for p in tree:
        try:
            name = p.name()
        except psutil.Error:
            continue
        if p.pid in workers:
            labels[p.pid] = workers[p.pid]
        elif p.pid == router:
            labels[p.pid] = "router"
        elif p.pid == stack.proc.pid:
            labels[p.pid] = "launcher"
        elif name == "redis-server":
            labels[p.pid] = "redis-server"
    for pid, role in workers.items():
        try:
            for child in psutil.Process(pid).children(recursive=True):
                labels[child.pid] = f"{role} engine"
        except psutil.Error:
            continue
    for p in tree:
        labels.setdefault(p.pid, "ray (other)")
    return labels


def _process_figures(pid: int) -> dict[str, float] | None:
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return {"rss_mb": p.memory_info().rss / 2**20, "fds": float(p.num_fds()),
                    "threads": float(p.num_threads()), "processes": 1.0}
    except psutil.Error:
        return None


def _groups(stack: UpStack, roles: dict[int, str]) -> dict[str, dict[str, float]]:
    """Each group's figures, summed over its processes."""
    groups: dict[str, dict[str, float]] = {}
    for pid, label in label_processes(stack, roles).items():
        figures = _process_figures(pid)
        if figures is None:
            continue
        group = groups.setdefault(label, dict.fromkeys(figures, 0.0))
        for k, v in figures.items():
            group[k] += v
    return groups


async def sample(stack: UpStack) -> Sample:
    """One sample of everything (what cannot be read this time is left out)."""
    out = Sample(time.time())
    try:
        records = await stack.records()
        out.redis_keys = await stack.redis_keys()
    except Exception:
        records = []
    roles = {w.pid: w.role for w in records}
    # In a thread: a /proc read of a process that is mapping or freeing gigabytes can
    # block for seconds, which must not hold up the client streams on this event loop.
    out.groups = await asyncio.to_thread(_groups, stack, roles)
    for w in records:
        if not w.metrics_port:
            continue
        try:
            samples = await asyncio.to_thread(scrape_samples, w.metrics_port)
        except OSError:
            continue
        for name, value in samples:
            if name == KV_USAGE and w.worker_id not in out.kv_usage:
                out.kv_usage[w.worker_id] = value
            elif STAGED.match(name):
                out.staged[f"{w.worker_id}/{name}"] = value
    return out


def series(samples: list[Sample]) -> dict[str, Any]:
    """Samples as JSON-ready columns: t, and per group and figure a list of values."""
    groups = sorted({g for s in samples for g in s.groups})
    figures = ("rss_mb", "fds", "threads", "processes")
    return {
        "t": [s.t for s in samples],
        "groups": {g: {f: [s.groups.get(g, {}).get(f) for s in samples] for f in figures}
                   for g in groups},
        "redis_keys": [s.redis_keys for s in samples],
        "kv_usage": {w: [s.kv_usage.get(w) for s in samples]
                     for w in sorted({w for s in samples for w in s.kv_usage})},
        "staged": {k: [s.staged.get(k) for s in samples]
                   for k in sorted({k for s in samples for k in s.staged})},
    }
