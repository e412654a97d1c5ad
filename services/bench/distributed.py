"""Load generation spread over Ray actors, for when one client process cannot keep up.

One schedule is computed from the arrival settings, as for a single process; actor k of n
sends requests k, k + n, k + 2n, ... of it (a `Share`), every actor counting from the same
wall-clock start, so the server sees the same arrival process whatever n is. Each actor
builds its own connections to the target. Their records come back to the driver and are
merged into one run, summarised and plotted like any other.

Measure one process's ceiling first (``benchmarks/harness_ceiling.py``): below it a single
process is simpler and as exact. Across machines the actors' clocks are assumed to be in
NTP sync; a skew shows up as a shifted start, never in a request's own latencies, which
are measured on one clock.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from services.bench.runner import Runner, RunResult, Share
from services.bench.targets import Target
from services.traffic.arrivals import ArrivalConfig
from services.traffic.request import RequestSpec

# Actors need a moment to receive the specs and wake up before the first send.
START_DELAY_S = 2.0


class LoadGenerator:
    """One load-generating process. Wrapped with `ray.remote` by `RayDriver`."""

    def __init__(self, make_target: Callable[[], Target], drain_timeout_s: float,
                 name: str) -> None:
        self.runner = Runner(make_target(), progress=False, drain_timeout_s=drain_timeout_s,
                             generator_id=f"{name}@{socket.gethostname()}")

    async def start(self) -> None:
        await self.runner.start()

    async def run(self, specs: Sequence[RequestSpec], arrivals: ArrivalConfig, label: str,
                  num_requests: int | None, share: Share) -> RunResult:
        return await self.runner.run(specs, arrivals, label, num_requests, share)

    async def finished(self) -> int:
        return self.runner.finished_requests()

    async def close(self) -> None:
        await self.runner.close()


class RayDriver:
    """Runs each benchmark run on `generators` Ray actors and merges their records.

    Without ``ray_address`` a local Ray instance is started (and stopped by `close`).
    ``generator_cpus`` is what each actor reserves: 0 packs them anywhere, 1 gives each
    its own core. Actors are spread over the cluster's nodes where Ray can."""

    def __init__(self, make_target: Callable[[], Target], generators: int, *,
                 ray_address: str | None = None, generator_cpus: float = 0.0,
                 progress: bool = True, drain_timeout_s: float = 30.0) -> None:
        if generators < 2:
            raise ValueError("spreading load needs at least 2 generators")
        self.make_target = make_target
        self.generators = generators
        self.ray_address = ray_address
        self.generator_cpus = generator_cpus
        self.progress = progress
        self.drain_timeout_s = drain_timeout_s
        self.actors: list[Any] = []
        self._own_ray = False

    async def start(self) -> None:
        import ray

        if not ray.is_initialized():
            self._own_ray = not self.ray_address
            ray.init(address=self.ray_address, include_dashboard=False, log_to_driver=True,
                     **({} if self.ray_address else {"object_store_memory": 256 << 20}))
        remote = ray.remote(LoadGenerator).options(
            num_cpus=self.generator_cpus, scheduling_strategy="SPREAD",
            max_concurrency=1000)  # async actor: `finished` answers while `run` runs
        self.actors = [remote.remote(self.make_target, self.drain_timeout_s, f"gen{k}")
                       for k in range(self.generators)]
        await asyncio.gather(*(a.start.remote() for a in self.actors))

    async def run(self, specs: Sequence[RequestSpec], arrivals: ArrivalConfig,
                  label: str = "run", num_requests: int | None = None) -> RunResult:
        import ray

        specs_ref = ray.put(list(specs))  # once into the object store, not once per actor
        start_at = time.time() + START_DELAY_S
        runs = [asyncio.ensure_future(
            actor.run.remote(specs_ref, arrivals, label, num_requests,
                             Share(k, self.generators, start_at)))
            for k, actor in enumerate(self.actors)]
        total = None if arrivals.duration_s is not None else (num_requests or len(specs))
        with tqdm(total=total, desc=f"{label} ({self.generators} generators)", unit="req",
                  dynamic_ncols=True, disable=not self.progress) as bar:
            while not all(r.done() for r in runs):
                await asyncio.wait(runs, timeout=1.0)
                counts = await asyncio.gather(*(a.finished.remote() for a in self.actors))
                bar.update(sum(counts) - bar.n)
        parts: list[RunResult] = [r.result() for r in runs]
        records = sorted((rec for part in parts for rec in part.records),
                         key=lambda rec: rec.index)
        return RunResult(label, arrivals, records, start_at, max(p.wall_s for p in parts))

    async def close(self) -> None:
        import ray

        if self.actors:
            await asyncio.gather(*(a.close.remote() for a in self.actors),
                                 return_exceptions=True)
            for actor in self.actors:
                ray.kill(actor)
            self.actors = []
        if self._own_ray:
            ray.shutdown()
