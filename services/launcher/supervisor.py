"""The supervisor of `pdserve up`: named Ray actors per role, kept at their desired
counts, and probed.

Ray restarts an actor whose process dies, but not one whose process hangs (a SIGSTOP, a
wedged event loop) or whose service stopped while the process lives on. So every
`probe_interval_s` the supervisor calls `ServiceActor.alive` on each serving actor with a
`probe_timeout_s` deadline: an actor whose service stopped, or that misses
`probe_failures` probes in a row, is killed, and Ray starts it again (a new engine, a new
restart epoch). An actor that does not get ready within `start_timeout_s` is treated the
same. Every restart is logged and counted in `pdserve_supervisor_restarts_total{role,
reason}` (reason: hang, stopped, start_timeout, crashed = found restarted by Ray, died =
gone for good, replaced).

An actor that is no longer wanted (`pdserve scale`, the live planner, `pdserve down`) is
drained before it is ended: a worker leaves the registry at once, so routers send it
nothing new, and its running streams get the server's grace period to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from services.launcher.actor_spec import ActorSpec, ray_options
from services.launcher.actors import ServiceActor
from services.launcher.settings import LauncherConfig

log = logging.getLogger(__name__)

RESTARTS = Counter("pdserve_supervisor_restarts", "actors restarted, by role and reason "
                   "(hang, stopped, start_timeout, crashed, died)", ["role", "reason"])


@dataclass
class Tracked:
    """One named actor and what the supervisor last saw of it."""

    handle: Any
    role: str
    state: str = "starting"  # starting: waiting for ready(); serving: probed
    ready: asyncio.Task[dict[str, Any]] | None = None
    since: float = field(default_factory=time.monotonic)
    pid: int = 0
    misses: int = 0
    restarting: bool = False  # killed by the supervisor: the next pid is expected
    group: Any = None  # the placement group of a multi-GPU worker, removed with it


async def _result(ref: Any) -> Any:
    return await ref


@dataclass(frozen=True)
class ProbeSettings:
    interval_s: float = 2.0
    timeout_s: float = 5.0
    failures: int = 2
    start_timeout_s: float = 900.0

    @classmethod
    def of(cls, launcher: LauncherConfig) -> ProbeSettings:
        return cls(launcher.actor_probe_interval_s, launcher.actor_probe_timeout_s,
                   launcher.actor_probe_failures, launcher.actor_start_timeout_s)


class Supervisor:
    """Creates, probes and stops the stack's actors; `spec(role, index)` says how each
    one is made (actor_spec.py)."""

    def __init__(self, spec: Callable[[str, int], ActorSpec], probes: ProbeSettings,
                 local_cluster: bool, drain_timeout_s: float = 30.0) -> None:
        import ray

        self.ray = ray
        self.remote = ray.remote(ServiceActor)
        self.spec = spec
        self.probes = probes
        # On a local cluster the actor's pid is a process on this machine: a hung one is
        # SIGKILLed directly too, which works on a stopped process whatever Ray does.
        self.local_cluster = local_cluster
        self.actors: dict[str, Tracked] = {}
        # Actors being stopped: they drain first (leave the registry, let running streams
        # finish), for up to `drain_timeout_s`; their names are not reused meanwhile.
        self.drain_timeout_s = drain_timeout_s
        self.retiring: dict[str, asyncio.Future[None]] = {}

    def ensure(self, role: str, count: int) -> None:
        """Start the missing actors of `role` and retire those beyond `count` (highest
        index first); called from the event loop, every reconcile round."""
        for i in range(count):
            name = f"{role}-{i}"
            if name not in self.actors and name not in self.retiring:  # else: next round
                log.info("starting %s", name)
                spec = self.spec(role, i)
                options, group = ray_options(spec.options)
                handle = self.remote.options(**options).remote(spec.args)
                # Counted by its role (prefill, decode, router), whatever model it serves.
                self.actors[name] = Tracked(handle, spec.options.role, group=group)
        extra = sorted((n for n in self.actors if n.startswith(f"{role}-")
                        and int(n.rsplit("-", 1)[1]) >= count), reverse=True)
        for name in extra:
            self._start_retiring(name)

    def _remove_group(self, t: Tracked) -> None:
        if t.group is not None:
            with contextlib.suppress(Exception):
                self.ray.util.remove_placement_group(t.group)
            t.group = None

    def _start_retiring(self, name: str) -> None:
        self.retiring[name] = asyncio.ensure_future(self._retire(name, self.actors.pop(name)))

    async def _retire(self, name: str, t: Tracked) -> None:
        """Drain a serving actor (bounded), then end it. One still starting has nothing
        to drain and may not answer while its engine loads: it is ended at once."""
        if t.ready is not None:
            t.ready.cancel()
        try:
            if t.state == "serving":
                # No duration here: the actor's server logs the one that counts, its
                # `grace_s` for running streams (`drain_timeout_s` only bounds a hang).
                log.info("draining %s", name)
                await asyncio.wait_for(_result(t.handle.drain.remote()), self.drain_timeout_s)
        except Exception as e:  # timed out, or already gone (a cancellation passes)
            log.warning("%s did not drain (%s); stopping it", name, type(e).__name__)
        finally:
            with contextlib.suppress(Exception):
                self.ray.kill(t.handle, no_restart=True)
            self._remove_group(t)
            self.retiring.pop(name, None)
        log.info("stopped %s", name)

    async def wait_ready(self, timeout: float = 900.0) -> dict[str, dict[str, Any]]:
        """The first start: every actor's ready() (an error in one stops `pdserve up`,
        which is where a wrong setting shows)."""
        names = list(self.actors)
        infos = await asyncio.wait_for(asyncio.gather(
            *(_result(self.actors[n].handle.ready.remote()) for n in names)), timeout)
        for name, info in zip(names, infos, strict=True):
            self._serving(name, self.actors[name], info)
        return dict(zip(names, infos, strict=True))

    def _serving(self, name: str, t: Tracked, info: dict[str, Any]) -> None:
        pid = int(info.get("pid", 0))
        if t.pid and pid != t.pid and not t.restarting:
            # The process changed without the supervisor killing it: Ray restarted it.
            RESTARTS.labels(t.role, "crashed").inc()
            log.warning("%s was restarted by Ray (pid %d -> %d)", name, t.pid, pid)
        elif t.restarting:
            log.info("%s is serving again (pid %d)", name, pid)
        t.state, t.pid, t.misses, t.restarting, t.ready = "serving", pid, 0, False, None

    async def watch(self) -> None:
        """Probe every actor forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.probes.interval_s)
            try:
                await self.probe_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # a probe round must never end supervision
                log.exception("probing the actors failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(n, t) for n, t in list(self.actors.items())))

    async def _probe(self, name: str, t: Tracked) -> None:
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        if t.state == "starting":
            self._check_start(name, t)
            return
        try:
            alive = await asyncio.wait_for(_result(t.handle.alive.remote()),
                                           self.probes.timeout_s)
        except TimeoutError:
            t.misses += 1
            log.warning("%s did not answer its probe in %.0f s (%d of %d)", name,
                        self.probes.timeout_s, t.misses, self.probes.failures)
            if t.misses >= self.probes.failures:
                self.restart(name, t, "hang")
            return
        except ActorUnavailableError:  # Ray is restarting it (its process died)
            t.state, t.since = "starting", time.monotonic()
            return
        except ActorDiedError:
            self._gone(name, t)
            return
        except Exception as e:  # the service raised: it stopped
            log.warning("%s: its service stopped: %s", name, e)
            alive = False
        if alive:
            t.misses = 0
        else:
            self.restart(name, t, "stopped")

    def _check_start(self, name: str, t: Tracked) -> None:
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        if t.ready is None:
            t.ready = asyncio.ensure_future(_result(t.handle.ready.remote()))
            return
        if not t.ready.done():
            if time.monotonic() - t.since > self.probes.start_timeout_s:
                self.restart(name, t, "start_timeout")
            return
        try:
            info = t.ready.result()
        except ActorUnavailableError:  # still restarting: ask again next round
            t.ready = None
            return
        except ActorDiedError:
            self._gone(name, t)
            return
        except Exception as e:
            log.warning("%s stopped while starting: %s", name, e)
            self.restart(name, t, "stopped")
            return
        self._serving(name, t, info)

    def restart(self, name: str, t: Tracked, reason: str) -> None:
        """Kill the actor so that Ray starts it again."""
        log.warning("restarting %s (pid %d): %s", name, t.pid, reason)
        RESTARTS.labels(t.role, reason).inc()
        with contextlib.suppress(Exception):
            self.ray.kill(t.handle, no_restart=False)
        if self.local_cluster and t.pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(t.pid, signal.SIGKILL)
        if t.ready is not None:
            t.ready.cancel()
        t.state, t.ready, t.since, t.misses, t.restarting = (
            "starting", None, time.monotonic(), 0, True)

    def _gone(self, name: str, t: Tracked) -> None:
        """Dead for good (out of restarts, killed from outside): `ensure` replaces it."""
        log.warning("%s is gone; replacing it", name)
        RESTARTS.labels(t.role, "died").inc()
        self._remove_group(t)
        self.actors.pop(name, None)

    async def stop_all(self) -> None:
        """Retire every actor at once (each drains, bounded) and wait for them all."""
        for name in list(self.actors):
            self._start_retiring(name)
        await asyncio.gather(*self.retiring.values(), return_exceptions=True)
