"""Drives one run or a rate sweep against a target and fills one record per request.

The dispatch loop sends request i at its scheduled offset (``services.traffic.arrivals``),
waiting first for a concurrency slot when a cap is set, so requests leave in order and a
capped run is a closed loop. Every request runs as its own task; the run ends when all have
finished, or at ``duration_s + drain_timeout_s``, when the rest are cancelled (which
aborts them server-side) and recorded as ``CANCELLED_BY_CLIENT``. Nothing here busy-waits:
the loop sleeps until the next send.

A replayed trace brings its own send times, and a later turn of a conversation names the
request it follows (``RequestSpec.after``): it is sent at its time or, if later, when that
request has finished (its record's ``scheduled_s`` is then that moment). Only turns sent
by the same runner wait for each other: spread over several generators, a turn waits only
for one its own generator sent.

Records carry wall-clock send times and a generator id, so records from several
load-generator processes can be concatenated and summarised as one run: a `Share` makes a
runner send only every n-th request of the schedule (``distributed`` spreads a run over
Ray actors that way).
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
from tqdm import tqdm

from services.bench.targets import ChunkEvent, Target, TargetError
from services.traffic.arrivals import ArrivalConfig, schedule
from services.traffic.latency import tpot
from services.traffic.record import RequestRecord
from services.traffic.request import RequestSpec


@dataclass(frozen=True, slots=True)
class Share:
    """This generator's part of a run spread over several: requests ``index``, ``index +
    of``, ... of the one schedule, all generators starting at the same wall-clock time."""

    index: int
    of: int
    start_at: float  # epoch seconds

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.of:
            raise ValueError(f"share {self.index} of {self.of} does not exist")


@dataclass(slots=True)
class RunResult:
    label: str
    arrivals: ArrivalConfig
    records: list[RequestRecord]
    started_at: float  # epoch seconds
    wall_s: float  # the run's length as the runner saw it, drain included
    group: str = ""  # with --runs: the label of the repeated run this is one repetition of


@dataclass(slots=True)
class _Live:
    """Running figures for the progress bar, over the most recent requests."""

    bar: tqdm
    started: float
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    tpots: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    running: int = 0
    done: int = 0
    errors: int = 0
    out_tokens: int = 0
    shown_at: float = 0.0

    def finished(self, rec: RequestRecord) -> None:
        self.running -= 1
        self.done += 1
        if rec.ok:
            if rec.ttft_s is not None:
                self.ttfts.append(rec.ttft_s)
            if (t := tpot(rec)) is not None:
                self.tpots.append(t)
            self.out_tokens += rec.output_tokens
        else:
            self.errors += 1
        self.bar.update(1)
        if time.perf_counter() - self.shown_at >= 1.0:  # numpy per completion costs too much
            self.show()

    def show(self) -> None:
        now = self.shown_at = time.perf_counter()
        self.bar.set_postfix(
            run=self.running, err=self.errors,
            ttft50=f"{np.median(self.ttfts):.3f}" if self.ttfts else "-",
            tpot50=f"{np.median(self.tpots):.4f}" if self.tpots else "-",
            tok_s=f"{self.out_tokens / max(now - self.started, 1e-9):.0f}",
            refresh=False)


@dataclass(slots=True)
class _Run:
    """State of one run in progress, shared by its dispatcher and request tasks."""

    label: str
    arrivals: ArrivalConfig
    specs: Sequence[RequestSpec]
    indices: np.ndarray  # which requests of the schedule this generator sends
    offsets: np.ndarray  # their send times, seconds after t0
    live: _Live
    t0: float  # perf_counter() at the start
    epoch0: float  # time.time() at the same moment: turns perf_counter into wall clock
    end: float  # perf_counter() after which nothing is sent; inf without a duration
    cap: asyncio.Semaphore | None
    records: list[RequestRecord] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    finished: dict[int, asyncio.Event] = field(default_factory=dict)  # by request index


class Runner:
    def __init__(self, target: Target, *, progress: bool = True,
                 drain_timeout_s: float = 30.0, generator_id: str | None = None) -> None:
        self.target = target
        self.progress = progress
        self.drain_timeout_s = drain_timeout_s
        self.generator_id = generator_id or f"{socket.gethostname()}:{os.getpid()}"
        self.live: _Live | None = None  # the run in progress, for progress reports

    async def start(self) -> None:
        await self.target.start()

    async def close(self) -> None:
        await self.target.close()

    def finished_requests(self) -> int:
        """Requests of the current run that have ended (for a remote progress bar)."""
        return 0 if self.live is None else self.live.done

    async def run(self, specs: Sequence[RequestSpec], arrivals: ArrivalConfig,
                  label: str = "run", num_requests: int | None = None,
                  share: Share | None = None) -> RunResult:
        """Send ``num_requests`` requests (default: one per spec, specs reused in a cycle)
        on the ``arrivals`` schedule; returns the records of the requests actually sent.

        With a ``share``, only that share of the schedule is sent, from its start time;
        a concurrency cap is split evenly between the generators."""
        self.live = None
        offsets = schedule(arrivals, specs, num_requests or len(specs))
        indices = np.arange(len(offsets))
        cap = arrivals.max_concurrency
        if share is not None:
            indices = indices[share.index::share.of]
            offsets = offsets[share.index::share.of]
            cap = math.ceil(cap / share.of) if cap else cap
            await asyncio.sleep(max(0.0, share.start_at - time.time()))
        # A duration-limited run ends on the clock, not at a count: no total to show.
        total = None if arrivals.duration_s is not None else len(offsets)
        bar = tqdm(total=total, desc=label, unit="req", dynamic_ncols=True,
                   mininterval=0.5, disable=not self.progress)
        t0 = time.perf_counter()
        run = _Run(label, arrivals, specs, indices, offsets, _Live(bar, t0), t0, time.time(),
                   t0 + (arrivals.duration_s or math.inf),
                   asyncio.Semaphore(cap) if cap else None)
        self.live = run.live
        dispatch = asyncio.create_task(self._dispatch(run))
        try:
            # The dispatcher may be blocked on a concurrency slot; the duration still ends it.
            if not (await asyncio.wait([dispatch], timeout=_until(run.end)))[0]:
                dispatch.cancel()
            await asyncio.gather(dispatch, return_exceptions=True)
            bar.total = len(run.records)
            if run.tasks:
                _, pending = await asyncio.wait(
                    run.tasks, timeout=_until(run.end + self.drain_timeout_s))
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            dispatch.cancel()  # interrupted (Ctrl-C): stop sending, abort what is in flight
            for task in run.tasks:
                task.cancel()
            run.live.show()
            bar.close()
        return RunResult(label, arrivals, run.records, run.epoch0, time.perf_counter() - t0)

    async def _dispatch(self, run: _Run) -> None:
        """Sends request i at t0 + offsets[i], after taking a concurrency slot if capped."""
        for i, offset in zip(run.indices.tolist(), run.offsets.tolist(), strict=True):
            delay = run.t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if run.cap is not None:
                await run.cap.acquire()
            if time.perf_counter() >= run.end:
                if run.cap is not None:
                    run.cap.release()
                return
            spec = run.specs[i % len(run.specs)]
            rec = RequestRecord(
                run=run.label, index=i, request_id=f"bench-{run.label}-{i}-{os.getpid()}",
                kind=spec.kind, prompt_tokens=len(spec.prompt_ids),
                max_tokens=spec.output_len, scheduled_s=offset,
                # Warm-up by the actual send time: in a closed loop every offset is 0.
                warmup=run.arrivals.is_warmup(i, time.perf_counter() - run.t0),
                generator=self.generator_id)
            run.records.append(rec)
            run.finished[i] = asyncio.Event()
            run.live.running += 1
            run.tasks.append(asyncio.create_task(self._one(run, rec, spec)))

    async def _one(self, run: _Run, rec: RequestRecord, spec: RequestSpec) -> None:
        start = time.perf_counter()
        rec.send_time = run.epoch0 + (start - run.t0)
        try:
            previous = run.finished.get(spec.after) if spec.after is not None else None
            if previous is not None and not previous.is_set():
                await previous.wait()  # the conversation's earlier turn
                start = time.perf_counter()
                rec.scheduled_s = start - run.t0
            rec.send_time = run.epoch0 + (start - run.t0)
            async for event in self.target.stream(spec, rec.request_id):
                if isinstance(event, ChunkEvent):
                    rec.chunk_offsets.append(event.time - start)
                    rec.chunk_tokens.append(event.tokens)
                    continue
                rec.e2e_s = event.time - start
                rec.finish_reason = event.finish_reason
                rec.output_tokens = (event.completion_tokens or sum(rec.chunk_tokens)
                                     or len(rec.chunk_offsets))
                rec.cached_tokens = event.cached_tokens
                rec.server = event.timings
                rec.ok = True
        except TargetError as exc:
            self._fail(rec, start, exc.code, exc.message)
        except asyncio.CancelledError:
            # Our own cancel at the duration limit; the record says so, and the run goes on.
            self._fail(rec, start, "CANCELLED_BY_CLIENT", "run duration limit reached")
        except Exception as exc:  # a harness bug must not stop the run: count it
            self._fail(rec, start, "CLIENT_ERROR", f"{type(exc).__name__}: {exc}")
        finally:
            if run.cap is not None:
                run.cap.release()
            run.finished[rec.index].set()
            run.live.finished(rec)

    @staticmethod
    def _fail(rec: RequestRecord, start: float, code: str, message: str) -> None:
        if rec.ok:  # the final message had arrived: the request itself succeeded
            return
        rec.error_code, rec.error_message = code, message
        rec.e2e_s = time.perf_counter() - start


class Driver(Protocol):
    """What runs benchmark runs: a `Runner` here, or one spread over Ray actors."""

    async def start(self) -> None: ...

    async def run(self, specs: Sequence[RequestSpec], arrivals: ArrivalConfig,
                  label: str = "run", num_requests: int | None = None) -> RunResult: ...

    async def close(self) -> None: ...


async def sweep(driver: Driver, specs: Sequence[RequestSpec], arrivals: ArrivalConfig,
                rates: Sequence[float], num_requests: int | None = None,
                pause_s: float = 0.0) -> list[RunResult]:
    """One run per rate, same requests and schedule seed, one after another."""
    results = []
    for k, rate in enumerate(rates):
        if k and pause_s > 0:
            await asyncio.sleep(pause_s)  # let the server's queues empty between rates
        cfg = replace(arrivals, rate=rate)
        results.append(await driver.run(specs, cfg, rate_label(rate), num_requests))
    return results


def rate_label(rate: float) -> str:
    return "rate-inf" if math.isinf(rate) else f"rate-{rate:g}"


def _until(deadline: float) -> float | None:
    """Seconds left until a perf_counter() deadline; None for no deadline."""
    return None if math.isinf(deadline) else max(0.0, deadline - time.perf_counter())
