"""Discrete-event simulation of a pdserve fleet: the router, the prefill and decode pools
(each engine an ``EngineSim``), and the KV transfer between them.

Events are arrivals, engine step ends and KV arrivals, taken in time order. The router
decides at arrival, with the policy pdserve's ``LoadAware`` uses: prompts up to
``local_prefill_max_tokens`` (or any prompt while the chosen prefill worker has more than
``saturated_queue_tokens`` queued, when that threshold is on) prefill on the decode
worker; otherwise the prefill worker with the fewest queued prompt tokens, and the decode
worker with the least load (running + waiting sequences per ``max_num_seqs``). Without a
prefill pool every request runs start to end on a decode-pool engine: colocated serving.

A shipped request's first token leaves the prefill worker at the end of its last prefill
step. Its KV streams layer by layer while the prompt computes, so it lands at the later of
(the prefill's first step + the whole transfer) and (the prefill's end + one layer's
share); then the decode worker loads it in its next step, which is longer by the copy's
CPU where the transport takes CPU from the engine (CPU hosts), and schedules it, with one
token left to compute, in the step after (``EngineSim.submit_remote``). Workers on one
host ship through shared memory (``shm``), as pdserve's do, when the profile measured that
transport.

Closer to a given stack, when the configuration says so:
  * ``FleetConfig.routing`` names the router's own policy and prefix index
    (routing.py): round robin, or the load policy on the approximate index or on the
    engines' KV events (precise: the blocks the decode worker holds are not shipped).
    Left empty, the router is the load policy on queue lengths alone, as above.
  * Every engine keeps a prefix cache of its KV blocks (prefix_cache.py), found by
    requests that carry their blocks' keys (``SimRequest.blocks``): a replay whose
    prompts share prefixes finds them on the engine that holds them, and only there.
  * ``PoolSpec.share`` engines time-share each set of cores (timeshare.py), as workers
    pinned to the same cores do.
  * ``SimRequest.after``: a later turn of a conversation is sent at its time or, if
    later, when the turn it follows has finished, as the replay's client does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from services.plan.costmodel import Profile, StepCost
from services.plan.engine_model import EngineLimits, EngineSim, Job
from services.plan.prefix_cache import PrefixCache
from services.plan.routing import EngineLoad, RouterModel
from services.plan.timeshare import SharedCores

ARRIVE, STEP, KV_READY = 0, 1, 2


@dataclass(slots=True, frozen=True)
class PoolSpec:
    """``engines`` engines of ``units`` cores (or GPUs) each; ``cost`` and
    ``kv_cache_tokens`` replace the profile's for this pool (a TP shape's, shapes.py)."""

    engines: int
    units: int
    max_num_batched_tokens: int = 0  # 0: the profile's default budget
    long_prefill_token_threshold: int = 0  # 0: no cap on one prompt's tokens per step
    cost: StepCost | None = None  # None: the profile's for ``units``
    kv_cache_tokens: int = 0  # 0: the profile's
    share: int = 1  # engines time-sharing each set of ``units`` cores

    def __post_init__(self) -> None:
        if self.share < 1 or self.engines % self.share:
            raise ValueError(f"{self.engines} engines cannot time-share cores {self.share} "
                             "to a set: give a share that divides the engines")


@dataclass(slots=True, frozen=True)
class FleetConfig:
    """One configuration to simulate; ``prefill`` None means colocated."""

    name: str
    decode: PoolSpec
    prefill: PoolSpec | None = None
    local_prefill_max_tokens: int = 0
    transport: str = "grpc"
    saturated_queue_tokens: int = 8192
    # Seconds to move a prompt's KV (its tokens in, per rank: shapes.py); None: the
    # whole payload over the profile's transport.
    kv_transfer_s: Callable[[int], float] | None = None
    routing: str = ""  # "": load by queue lengths alone; else one of routing.ROUTINGS
    block_tokens: int = 128  # tokens one key of ``SimRequest.blocks`` stands for

    @property
    def units(self) -> int:
        pools = [self.decode] + ([self.prefill] if self.prefill else [])
        return sum(p.engines // p.share * p.units for p in pools)


def same_host_transport(config: FleetConfig, profile: Profile) -> str:
    """The transport a pair of ``config`` ships KV over: workers on one host go through
    shared memory whatever network transport is configured (as pdserve's workers do),
    when the profile measured it; a fleet larger than one host uses the configured one."""
    if "shm" in profile.transports and config.units <= profile.units_total:
        return "shm"
    return config.transport


@dataclass(slots=True, frozen=True)
class SimRequest:
    """One request of the schedule."""

    send_s: float
    prompt: int
    out: int
    kind: str = ""
    blocks: tuple[bytes, ...] = ()  # chained keys of the prompt's whole blocks
    after: int | None = None  # the request (index) this one follows: an earlier turn


@dataclass(slots=True)
class SimResult:
    """When each token of one request reached the client (seconds after the run start)."""

    request: SimRequest
    token_times: list[float] = field(default_factory=list)
    ok: bool = True
    path: str = "local"  # local (prefilled where it decodes) or shipped
    sent_s: float = -1.0  # when it was sent: its send time, or later behind a turn

    def __post_init__(self) -> None:
        if self.sent_s < 0:
            self.sent_s = self.request.send_s

    @property
    def end_s(self) -> float:
        return self.token_times[-1] if self.token_times else self.sent_s


@dataclass(slots=True)
class _Flight:
    """A request in flight: where it is and what it has emitted."""

    index: int
    decode_engine: int
    first_s: float = -1.0
    overhead_s: float = 0.0
    prefill_engine: int = -1
    reuse_tokens: int = 0  # prompt tokens the decode worker holds: not shipped


class Fleet:
    """The simulation of one configuration over one schedule."""

    def __init__(self, config: FleetConfig, profile: Profile) -> None:
        self.config, self.profile = config, profile
        self.transport = same_host_transport(config, profile)
        if self.transport not in profile.transports and config.prefill is not None:
            raise ValueError(f"the profile has no transport {self.transport!r}; profile it "
                             "again with `pdserve plan profile` on a host where it runs, "
                             f"or choose one of {', '.join(profile.transports)}")
        self.decodes = [self._engine(config.decode, f"decode{i}")
                        for i in range(config.decode.engines)]
        self.prefills = ([self._engine(config.prefill, f"prefill{i}")
                          for i in range(config.prefill.engines)] if config.prefill else [])
        self.engines = self.decodes + self.prefills
        # Engines that time-share cores: the set of each (None: cores of its own).
        self._cores: list[SharedCores | None] = []
        for pool, n in ((config.decode, len(self.decodes)),
                        (config.prefill, len(self.prefills))):
            for i in range(n):
                assert pool is not None
                if pool.share == 1:
                    self._cores.append(None)
                else:
                    self._cores.append(SharedCores() if i % pool.share == 0
                                       else self._cores[-1])
        self._due = [0] * len(self.engines)  # the event of each engine's step in flight
        self.router = (RouterModel(config.routing, profile.max_num_seqs,
                                   config.local_prefill_max_tokens,
                                   config.saturated_queue_tokens) if config.routing else None)
        self.index = [PrefixCache() for _ in self.prefills]  # the approximate index
        self._inbound = [0] * len(self.decodes)  # shipped requests whose KV is on its way
        self.shipped_bytes = 0.0
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0

    def _engine(self, pool: PoolSpec, name: str) -> EngineSim:
        limits = EngineLimits(pool.max_num_batched_tokens
                              or self.profile.default_max_num_batched_tokens,
                              self.profile.max_num_seqs,
                              pool.kv_cache_tokens or self.profile.kv_cache_tokens,
                              pool.long_prefill_token_threshold)
        engine = EngineSim(pool.cost or self.profile.cost(pool.units), limits, name)
        if block := self.config.block_tokens:
            engine.cache = PrefixCache(max(1, limits.kv_cache_tokens // block))
            engine.block_tokens = block
        return engine

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens every engine computed (not found cached, not shipped in)."""
        return sum(e.computed_tokens for e in self.engines)

    def _push(self, time: float, kind: int, arg: int) -> int:
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, kind, arg))
        return self._seq

    def _retime(self, ends: dict[int, float]) -> None:
        """Steps in flight end at ``ends``: their earlier events are stale."""
        for idx, end in ends.items():
            self.engines[idx].step_end = end
            self._due[idx] = self._push(end, STEP, idx)

    def _kick(self, idx: int, now: float) -> None:
        engine = self.engines[idx]
        if engine.step_end is None:
            end = engine.start_step(now)
            if end is None:
                return
            cores = self._cores[idx]
            self._retime({idx: end} if cores is None else cores.start(idx, now, end - now))

    def _decode_choice(self) -> int:
        def load(i: int) -> float:
            e = self.decodes[i]
            return e.requests / e.limits.max_num_seqs
        return min(range(len(self.decodes)), key=load)

    def _route(self, flight: _Flight, req: SimRequest, now: float) -> bool:
        """Sends the request where the router would; False: the router rejects it."""
        if self.router is not None:
            return self._route_by_router(flight, req, now)
        cfg = self.config
        flight.decode_engine = self._decode_choice()
        local = not self.prefills or req.prompt <= cfg.local_prefill_max_tokens
        p = -1
        if not local:
            p = min(range(len(self.prefills)), key=lambda i: self.prefills[i].queued_tokens)
            saturated = self.prefills[p].queued_tokens > cfg.saturated_queue_tokens
            local = cfg.local_prefill_max_tokens > 0 and saturated
        self._dispatch(flight, req, None if local else p, now)
        return True

    def _load(self, engine: EngineSim, inbound: int = 0) -> EngineLoad:
        return EngineLoad(len(engine.waiting) + len(engine.landed) + len(engine.loading)
                          + inbound, engine.running, engine.queued_tokens,
                          engine.kv_used / engine.limits.kv_cache_tokens)

    def _route_by_router(self, flight: _Flight, req: SimRequest, now: float) -> bool:
        assert self.router is not None
        routing, block = self.config.routing, self.config.block_tokens
        hits: dict[int, int] = {}
        decode_hits: dict[int, int] = {}
        if routing == "approximate":
            hits = {i: c.hits(req.blocks) * block for i, c in enumerate(self.index)}
        elif routing == "precise":
            hits = {i: e.cache.hits(req.blocks) * block
                    for i, e in enumerate(self.prefills) if e.cache is not None}
            decode_hits = {i: e.cache.hits(req.blocks) * block
                           for i, e in enumerate(self.decodes) if e.cache is not None}
        route = self.router.choose(req.prompt, [self._load(e) for e in self.prefills],
                                   [self._load(e, n) for e, n in zip(self.decodes, self._inbound,
                                                                      strict=True)],
                                   hits, decode_hits)
        if route is None:
            return False
        flight.decode_engine = route.decode
        flight.reuse_tokens = min(route.reuse_tokens, req.prompt - 1)
        self._dispatch(flight, req, route.prefill, now)
        return True

    def _dispatch(self, flight: _Flight, req: SimRequest, prefill: int | None,
                  now: float) -> None:
        """The request to its decode worker (``prefill`` None) or to that prefill worker."""
        d = flight.decode_engine
        if prefill is None:
            engine, idx = self.decodes[d], d
            job = Job(flight.index, req.prompt, req.out, blocks=req.blocks)
            self.results[flight.index].path = "local"
        else:
            engine, idx = self.prefills[prefill], len(self.decodes) + prefill
            job = Job(flight.index, req.prompt, 1, blocks=req.blocks)
            self.results[flight.index].path = "shipped"
            flight.prefill_engine = prefill
            if req.out > 1:
                self._inbound[d] += 1
        flight.overhead_s = engine.cost.request_s
        engine.submit(job)
        self._kick(idx, now)

    def _shipped(self, flight: _Flight, job: Job, end: float) -> None:
        """A prefill finished: its KV is on its way to the decode worker."""
        req = self.requests[flight.index]
        self.index[flight.prefill_engine].insert(req.blocks)  # the approximate index
        if req.out <= 1:
            self._end(flight.index, self.results[flight.index].end_s)
            return
        transport = self.profile.transports[self.transport]
        tokens = req.prompt - flight.reuse_tokens  # the decode worker holds the rest
        nbytes = tokens * self.profile.kv_bytes_per_token
        self.shipped_bytes += nbytes
        if self.config.kv_transfer_s is not None:
            whole = self.config.kv_transfer_s(tokens)
        else:
            whole = transport.transfer_s(nbytes)
        layers = max(1, int(self.profile.model.get("layers", 1)))
        ready = max(job.scheduled_at + whole, end + whole / layers)
        stall = transport.receiver_cpu_s_per_gb * nbytes / 1e9
        self._pending[flight.index] = Job(flight.index, 1, req.out - 1, req.prompt - 1, stall,
                                          blocks=req.blocks)
        self._push(ready, KV_READY, flight.index)

    def _end(self, index: int, at: float) -> None:
        """Request ``index`` has finished at ``at`` (or failed): the turns behind it go."""
        self._ended.add(index)
        for waiter in self._waiters.pop(index, []):
            self._push(at, ARRIVE, waiter)

    def _step_done(self, idx: int, now: float) -> None:
        engine = self.engines[idx]
        firsts, done = engine.finish_step()
        on_prefill = idx >= len(self.decodes)
        for job in firsts:
            flight = self._flights[job.rid]
            if flight.first_s < 0:
                flight.first_s = now
                if on_prefill:
                    self.results[job.rid].token_times.append(now + flight.overhead_s)
                    self._shipped(flight, job, now)
        for job in done:
            if on_prefill:
                continue
            times = engine.token_times(job)
            shift = self._flights[job.rid].overhead_s
            out = self.results[job.rid].token_times
            if self._light:  # the first and the last token are all a TTFT/TPOT check needs
                times = times[-1:] if out else [times[0], times[-1]][:len(times)]
            out.extend(t + shift for t in times)
            self._end(job.rid, self.results[job.rid].end_s)
        self._kick(idx, now)

    def run(self, requests: list[SimRequest], horizon_s: float | None = None,
            light: bool = False) -> list[SimResult]:
        """Simulates every request to its end; those that end after ``horizon_s`` (the
        benchmark's duration plus its drain timeout) are marked failed, as the benchmark
        cancels them. A request that can never fit an engine's KV cache fails at once.
        ``light`` keeps only each request's first and last token times (large fleets)."""
        self.requests, self._light = requests, light
        self.results = [SimResult(r) for r in requests]
        self._flights: dict[int, _Flight] = {}
        self._pending: dict[int, Job] = {}
        self._ended: set[int] = set()
        self._waiters: dict[int, list[int]] = {}  # a request -> the turns that follow it
        capacity = min(e.limits.kv_cache_tokens for e in self.engines)
        for i, r in enumerate(requests):
            if r.after is not None and not 0 <= r.after < i:
                raise ValueError(f"request {i} follows request {r.after}: a turn follows "
                                 "an earlier request of the schedule")
            self._push(r.send_s, ARRIVE, i)
        while self._heap:
            now, seq, kind, arg = heapq.heappop(self._heap)
            if kind == STEP:
                if seq != self._due[arg]:
                    continue  # re-timed since: the cores' sharing changed
                if (cores := self._cores[arg]) is not None:
                    self._retime(cores.finish(arg, now))
                self.engines[arg].step_end = now
                self._step_done(arg, now)
            elif kind == ARRIVE:
                req = requests[arg]
                if req.after is not None and req.after not in self._ended:
                    self._waiters.setdefault(req.after, []).append(arg)
                    continue
                self.results[arg].sent_s = now
                self._flights[arg] = flight = _Flight(arg, 0)
                if req.prompt + req.out > capacity or not self._route(flight, req, now):
                    self.results[arg].ok = False
                    self._end(arg, now)
            else:
                flight = self._flights[arg]
                self._inbound[flight.decode_engine] -= 1
                self.decodes[flight.decode_engine].submit_remote(self._pending.pop(arg))
                self._kick(flight.decode_engine, now)
        for res in self.results:
            if horizon_s is not None and res.end_s > horizon_s:
                res.ok = False
        return self.results

    def utilization(self, span_s: float) -> dict[str, float]:
        """Busy share of each engine over ``span_s`` seconds."""
        return {e.name: e.busy_s / span_s if span_s > 0 else 0.0 for e in self.engines}
