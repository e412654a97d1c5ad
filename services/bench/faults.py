"""Faults injected into a running stack at set times, and how long the stack took to be
whole again after each: processes killed or stopped in a `pdserve up` stack, and network
faults between the hosts of a network-namespace stack (services/bench/netns.py, netns_stack.py).

A fault is written ``KIND@SECONDS[:LASTS_S[:AMOUNT]]`` (``stop-decode@190:10`` adds how
long a stop lasts, ``loss@120:15:0.1`` how long a loss burst lasts and its share):

- ``kill-decode`` / ``kill-prefill``: SIGKILL of that worker's process (the pid in its
  registry record). Whole again when a record of that role with a new epoch and a new pid
  is registered.
- ``kill-redis``: SIGKILL of the stack's redis-server. Whole again when Redis answers
  and every worker that was registered before is registered again.
- ``stop-decode`` / ``stop-prefill``: SIGSTOP of the worker, SIGCONT after the given
  seconds. Whole again when that role heartbeats after the SIGCONT (the same process
  resumed) or a new epoch of it is registered (the supervisor replaced it as hung).

Network faults (a `network` must be given; each lasts LASTS_S, then the link is
restored; whole again when every worker registered before the fault has heartbeat to
Redis after the restore):

- ``cut-prefill-decode``: every packet between the prefill host and the decode host
  receiving a KV transfer at that moment is dropped (the fault waits for a transfer).
- ``cut-decode-router``: between the router and the decode host streaming the most.
- ``cut-router-redis``: between the router and Redis.
- ``partition-decode`` / ``partition-prefill``: that worker's host from every other host
  (the decode host streaming the most).
- ``loss``: AMOUNT (default 0.1) of the packets every host receives dropped at random.
- ``latency``: every packet a host receives held AMOUNT ms (default 100) before it is let
  in, in every host: a round trip between two hosts grows by twice that.

With `busy`, each fault waits (up to `busy_wait_s`) for a moment when `busy()` is true
(e.g. streams in flight), so that a fault never lands in a quiet gap of the schedule.
With a probe, a new request is sent the moment each fault is injected (and again every
quarter second while they fail): `served_s` is the time from the fault to its first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

PROCESS_KINDS = ("kill-decode", "kill-prefill", "kill-redis", "stop-decode", "stop-prefill")
NET_KINDS = ("cut-prefill-decode", "cut-decode-router", "cut-router-redis",
             "partition-decode", "partition-prefill", "loss", "latency")
KINDS = PROCESS_KINDS + NET_KINDS
DEFAULT_AMOUNT = {"loss": 0.1, "latency": 100.0}


class ChaosStack(Protocol):
    """What a fault plan reads from the stack under test (`UpStack`, `NetStack`)."""

    async def records(self) -> list[Any]: ...

    async def redis_ping(self) -> bool: ...

    def redis_pid(self) -> int | None: ...


class Network(Protocol):
    """Injects network faults (services/bench/netns_stack.py's `NetFaults`)."""

    async def begin(self, kind: str, amount: float) -> tuple[str, Callable[[], None]]: ...


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    at_s: float  # seconds after the load started
    stop_s: float = 10.0  # stop-* and network faults: how long it lasts
    amount: float = 0.0  # loss: share of packets dropped; latency: ms (0 = the default)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; choose from {KINDS}")
        if self.at_s < 0 or self.stop_s <= 0 or self.amount < 0:
            raise ValueError(f"bad times or amount in fault {self}")
        if self.kind == "loss" and not self.amount < 1:
            raise ValueError(f"a loss share is below 1: {self}")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``KIND@SECONDS[:LASTS_SECONDS[:AMOUNT]]``."""
        try:
            kind, when = text.split("@", 1)
            at, _, rest = when.partition(":")
            lasts, _, amount = rest.partition(":")
            return cls(kind, float(at), float(lasts) if lasts else 10.0,
                       float(amount) if amount else DEFAULT_AMOUNT.get(kind, 0.0))
        except ValueError as e:
            raise ValueError(f"bad fault {text!r} (KIND@SECONDS[:LASTS_SECONDS[:AMOUNT]]): "
                             f"{e}") from None

    @property
    def network(self) -> bool:
        return self.kind in NET_KINDS

    @property
    def role(self) -> str:
        return self.kind.split("-", 1)[1]

    def label(self) -> str:
        if self.kind == "loss":
            return f"loss {self.amount:.0%} {self.stop_s:g} s"
        if self.kind == "latency":
            return f"latency +{self.amount:g} ms {self.stop_s:g} s"
        if self.kind.startswith("stop") or self.network:
            return f"{self.kind} {self.stop_s:g} s"
        return self.kind


@dataclass(slots=True)
class FaultEvent:
    """One fault as it happened (epoch seconds)."""

    fault: Fault
    at: float = 0.0  # the signal was sent
    pid: int = 0  # the process signalled
    old_epoch: int = 0
    target: str = ""  # network faults: the link or host it hit ("prefill<->decode-grpc")
    workers: list[str] = field(default_factory=list)  # network faults: registered before
    resumed_at: float | None = None  # stop-*: SIGCONT sent; network faults: link restored
    recovered_at: float | None = None  # whole again (see the module docstring)
    recovered_how: str = ""
    error: str = ""
    served_s: float | None = None  # fault -> first token of a probe request sent after it
    probe_failures: int = 0  # probes refused or failed before that

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.at

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.fault.label()
        d["recovery_s"] = self.recovery_s
        return d


@dataclass(slots=True)
class FaultPlan:
    """Runs the faults of one run against a stack, each at its time after `t0`."""

    stack: ChaosStack
    faults: list[Fault]
    recover_timeout_s: float = 240.0
    # Sends one new request; returns the epoch time of its first token (raises if none).
    probe: Callable[[], Awaitable[float]] | None = None
    busy: Callable[[], bool] | None = None  # inject only while this holds (see above)
    busy_wait_s: float = 30.0
    network: Network | None = None  # needed by network faults
    events: list[FaultEvent] = field(default_factory=list)
    _probes: list[asyncio.Task[None]] = field(default_factory=list)

    async def run(self, t0: float) -> list[FaultEvent]:
        """Inject every fault at t0 + at_s (epoch seconds), one after another, watching
        each until the stack is whole again (or the next fault is due)."""
        for fault in sorted(self.faults, key=lambda f: f.at_s):
            await asyncio.sleep(max(0.0, t0 + fault.at_s - time.time()))
            give_up = time.time() + self.busy_wait_s
            while self.busy is not None and not self.busy() and time.time() < give_up:
                await asyncio.sleep(0.05)
            event = FaultEvent(fault)
            self.events.append(event)
            try:
                await self._inject(event)
            except Exception as e:  # a fault that could not be injected is reported
                event.error = f"{type(e).__name__}: {e}"
                continue
            later = [f.at_s for f in self.faults if f.at_s > fault.at_s]
            until = t0 + later[0] if later else event.at + self.recover_timeout_s
            await self._watch(event, min(until, event.at + self.recover_timeout_s))
        await asyncio.gather(*self._probes, return_exceptions=True)
        return self.events

    def _start_probe(self, event: FaultEvent) -> None:
        if self.probe is not None:
            self._probes.append(asyncio.create_task(self._probing(event)))

    async def _probing(self, event: FaultEvent) -> None:
        assert self.probe is not None
        while time.time() < event.at + self.recover_timeout_s:
            try:
                event.served_s = await self.probe() - event.at
                return
            except Exception:  # refused or broken: the stack is not serving yet
                event.probe_failures += 1
                await asyncio.sleep(0.25)

    async def _worker(self, role: str) -> tuple[int, int]:
        records = [w for w in await self.stack.records() if w.role == role]
        if not records:
            raise RuntimeError(f"no {role} worker registered")
        return records[0].pid, records[0].epoch

    async def _inject(self, event: FaultEvent) -> None:
        fault = event.fault
        if fault.network:
            await self._inject_network(event)
            return
        if fault.kind == "kill-redis":
            pid = await asyncio.to_thread(self.stack.redis_pid)
            if pid is None:
                raise RuntimeError("no redis-server in the stack's process tree")
            event.pid, event.at = pid, time.time()
            os.kill(pid, signal.SIGKILL)
            self._start_probe(event)
            return
        event.pid, event.old_epoch = await self._worker(fault.role)
        if fault.kind.startswith("kill"):
            event.at = time.time()
            os.kill(event.pid, signal.SIGKILL)
            self._start_probe(event)
            return
        event.at = time.time()
        os.kill(event.pid, signal.SIGSTOP)
        self._start_probe(event)
        try:
            await asyncio.sleep(fault.stop_s)
        finally:
            with contextlib.suppress(ProcessLookupError):  # replaced as hung meanwhile
                os.kill(event.pid, signal.SIGCONT)
            event.resumed_at = time.time()

    async def _inject_network(self, event: FaultEvent) -> None:
        fault = event.fault
        if self.network is None:
            raise RuntimeError(f"{fault.kind} is a network fault: it needs a stack on "
                               "network namespaces (benchmarks/chaos.py --net)")
        with contextlib.suppress(Exception):  # Redis away: nothing to wait for
            event.workers = sorted(w.worker_id for w in await self.stack.records())
        # The fault's moment is when it takes hold, after its hosts were chosen.
        target, undo = await self.network.begin(fault.kind, fault.amount)
        event.target, event.at = target, time.time()
        self._start_probe(event)
        try:
            await asyncio.sleep(fault.stop_s)
        finally:
            await asyncio.to_thread(undo)
            event.resumed_at = time.time()

    async def _watch(self, event: FaultEvent, deadline: float) -> None:
        fault = event.fault
        before = {"prefill", "decode"}
        while time.time() < deadline:
            try:
                records = await self.stack.records()
            except Exception:  # Redis away
                records = []
            now = time.time()
            roles = {w.role for w in records}
            if fault.network:
                restored = event.resumed_at or now
                fresh = {w.worker_id for w in records if w.updated > restored}
                if set(event.workers) <= fresh:
                    event.recovered_at = now
                    event.recovered_how = "every worker heartbeats after the restore"
                    return
            elif fault.kind == "kill-redis":
                if await self.stack.redis_ping() and before <= roles:
                    event.recovered_at, event.recovered_how = now, "Redis answers, workers " \
                        "registered again"
                    return
            else:
                mine = [w for w in records if w.role == fault.role]
                if any(w.epoch != event.old_epoch and w.pid != event.pid for w in mine):
                    event.recovered_at = now
                    event.recovered_how = "registered again with a new epoch"
                    return
                resumed = event.resumed_at
                if resumed is not None and any(
                        w.pid == event.pid and w.updated > resumed for w in mine):
                    event.recovered_at = now
                    event.recovered_how = "the stopped process heartbeats again"
                    return
            await asyncio.sleep(0.25)
