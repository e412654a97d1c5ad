"""Telling a hung worker (alive to TCP, silent to us: a stopped process, a wedged loop)
from a slow one, for every call the router has in flight.

One ticker task per event loop scans all watched calls a few times per `silence_s`
instead of one timer task per call: a task per call cost more than the rest of a short
request's routing. A call silent for `silence_s` gets a health probe; a worker that does
not answer within `probe_timeout_s` has its call cancelled and the watch marked hung.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.errors import FailedCall, WorkerFailure

TICKS_PER_SILENCE = 10  # a hang is seen at most silence_s / 10 late


async def answers(channel: grpc.aio.Channel, timeout_s: float) -> bool:
    """Whether the worker's gRPC server answers a health check in time (any status: a
    draining worker still serves the streams it has)."""
    try:
        await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return True


class Watch:
    """One call to a worker. `last` is set on every message (one timestamp per message
    on the stream's path); `hung` says why the call was cancelled, if it was."""

    __slots__ = ("call", "channel", "hung", "last", "probing", "role", "worker_id")

    def __init__(self, call: grpc.aio.Call, role: str, worker_id: str,
                 channel: grpc.aio.Channel) -> None:
        self.call, self.role, self.worker_id, self.channel = call, role, worker_id, channel
        self.last = time.monotonic()
        self.hung = ""
        self.probing = False

    def failure(self, streamed: int) -> WorkerFailure:
        return WorkerFailure(FailedCall(self.role, self.worker_id,
                                        grpc.StatusCode.UNAVAILABLE, self.hung), streamed)


class Liveness:
    """How long a call may stay silent before its worker is probed, how long the probe
    may take, and the calls being watched (`watch` ... `unwatch`)."""

    def __init__(self, silence_s: float = 1.0, probe_timeout_s: float = 1.0) -> None:
        self.silence_s, self.probe_timeout_s = silence_s, probe_timeout_s
        self._watches: set[Watch] = set()
        self._ticker: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()

    def watch(self, call: grpc.aio.Call, role: str, worker_id: str,
              channel: grpc.aio.Channel) -> Watch:
        w = Watch(call, role, worker_id, channel)
        self._watches.add(w)
        if self._ticker is None or self._ticker.done():
            # Started lazily on the caller's loop; it ends when nothing is watched.
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return w

    def unwatch(self, w: Watch) -> None:
        self._watches.discard(w)

    async def _tick(self) -> None:
        period = self.silence_s / TICKS_PER_SILENCE
        while self._watches:
            await asyncio.sleep(period)
            now = time.monotonic()
            for w in list(self._watches):
                if not w.probing and now - w.last >= self.silence_s:
                    w.probing = True
                    probe = asyncio.create_task(self._probe(w, now - w.last))
                    self._probes.add(probe)  # held: the loop keeps only weak references
                    probe.add_done_callback(self._probes.discard)

    async def _probe(self, w: Watch, quiet: float) -> None:
        if await answers(w.channel, self.probe_timeout_s):
            w.last = time.monotonic()  # slow, not hung: give it another period
            w.probing = False
            return
        if w in self._watches:
            w.hung = f"silent for {quiet:.1f} s and no answer to a liveness probe"
            w.call.cancel()
