"""Routing policies: pick the (prefill, decode) pair for a request. Pure Python over
registry records and the router's own in-flight counts; no sockets, no Redis.

Every policy answers with a `Choice`; `prefill=None` means "prefill on the decode
worker itself" (conditional disaggregation: a short prompt is not worth a KV transfer,
and a saturated prefill pool should not hold up requests a decode worker can take).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.registry.records import WorkerRecord, layout_differences

KV_FULL = 0.95  # a decode worker above this KV usage takes no new requests


@dataclass(frozen=True, slots=True)
class RouteInput:
    prompt_len: int
    # cached prefix tokens per prefill worker, from the prefix index
    prefix_hits: Mapping[str, int] = field(default_factory=dict)
    # cached prefix tokens per decode worker: known only from the engines' KV events
    decode_hits: Mapping[str, int] = field(default_factory=dict)
    # the hits come from the engines themselves (every prefill worker publishes its KV
    # events), not from the approximate index of where prompts were sent
    precise: bool = False


@dataclass(slots=True, eq=False)
class Flight:
    """One request this router sent one worker."""

    worker_id: str
    prompt_tokens: int  # still to prefill there; 0 once its first token came back
    # Of those, the leading tokens the worker's prefix cache holds (the index's hits):
    # looked up, not computed. Its queue counts whole prompts (vLLM's does).
    cached: int = 0
    sent: float = field(default_factory=time.time)  # wall clock, as reports are stamped


@dataclass(slots=True)
class LocalLoad:
    """What this router sent each worker that the worker's last load report cannot
    show yet. Reports lag by up to a heartbeat, so a request counts here from its dispatch
    until the worker reports after it (a worker without reports, as in the local pair,
    is known by these counts alone), and its prompt tokens only until its first token:
    a request that is decoding is no longer in anyone's prefill queue. The other way
    round, a prompt a report still counts as queued may have been prefilled since: those
    are taken off the reported queue until a report written after them arrives."""

    flights: dict[str, set[Flight]] = field(default_factory=dict)
    # worker id -> (sent, prefilled at, prompt tokens) of prompts prefilled lately
    drained: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)

    def sent(self, worker_id: str, prompt_tokens: int, cached: int = 0) -> Flight:
        flight = Flight(worker_id, prompt_tokens, min(cached, prompt_tokens))
        self.flights.setdefault(worker_id, set()).add(flight)
        return flight

    def prefilled(self, flight: Flight) -> None:
        if flight.prompt_tokens:
            self.drained.setdefault(flight.worker_id, []).append(
                (flight.sent, time.time(), flight.prompt_tokens))
        flight.prompt_tokens = flight.cached = 0

    def stale_queued(self, w: WorkerRecord) -> int:
        """Prompt tokens `w`'s last report counts as queued that were prefilled since
        (sent before the report was written, their first token back after it)."""
        entries = self.drained.get(w.worker_id)
        if not entries:
            return 0
        entries[:] = [e for e in entries if e[1] > w.updated]  # later reports show them
        if not entries:
            del self.drained[w.worker_id]
            return 0
        return sum(tokens for sent, _, tokens in entries if sent <= w.updated)

    def done(self, flight: Flight) -> None:
        mine = self.flights.get(flight.worker_id)
        if mine is not None:
            mine.discard(flight)
            if not mine:
                del self.flights[flight.worker_id]

    def _unreported(self, w: WorkerRecord) -> list[Flight]:
        return [f for f in self.flights.get(w.worker_id, ()) if f.sent > w.updated]

    def requests(self, w: WorkerRecord) -> int:
        return len(self._unreported(w))

    def prompt_tokens(self, w: WorkerRecord) -> int:
        """Prompt tokens `w` has to compute for what this router sent it since its last
        report (cached prefixes left out)."""
        return sum(f.prompt_tokens - f.cached for f in self._unreported(w))

    def cached_reported(self, w: WorkerRecord) -> int:
        """Cached prefix tokens of prompts `w`'s last report counts as queued that are
        still prefilling: its queue counts them, but they cost a lookup, not compute."""
        return sum(f.cached for f in self.flights.get(w.worker_id, ())
                   if f.sent <= w.updated and f.prompt_tokens)


@dataclass(frozen=True, slots=True)
class Choice:
    prefill: WorkerRecord | None  # None: prefill on the decode worker
    decode: WorkerRecord
    # for the pair-choice metric: "round_robin", "load", "prefix" (the prefill worker
    # holds the prompt's prefix), "decode_prefix" (only the decode worker does), "local_*"
    reason: str
    # The prompt's leading tokens the decode worker's engine caches (precise index only;
    # 0 otherwise or without a prefill worker): their KV is not shipped.
    reuse_tokens: int = 0
    # The prompt's leading tokens the prefill worker's cache holds, as the index says:
    # not computed there, so not counted in its queue.
    prefill_cached: int = 0


class Policy(Protocol):
    name: str

    def choose(self, prefills: Sequence[WorkerRecord], decodes: Sequence[WorkerRecord],
               req: RouteInput, local: LocalLoad) -> Choice | None: ...


def decode_has_room(d: WorkerRecord, local: LocalLoad) -> bool:
    busy = d.load.running + d.load.waiting + local.requests(d)
    return busy < d.capacity and d.load.kv_usage < KV_FULL


def prefill_queue(p: WorkerRecord, local: LocalLoad) -> int:
    """Prompt tokens waiting to be computed on a prefill worker: its last report, less
    what this router saw prefilled since and the cached prefixes of what it sent there,
    plus what it sent it since. A worker holding a conversation's prefix is not charged
    for the turns it only looks up."""
    reported = p.load.queued_prompt_tokens - local.stale_queued(p) - local.cached_reported(p)
    return max(0, reported) + local.prompt_tokens(p)


def prefill_pool_full(choice: Choice, local: LocalLoad, max_queued_tokens: int) -> str | None:
    """Why the chosen prefill worker takes no more work (its queue is at the bound), or
    None. The load policy picks the shortest queue, so a full choice means a full pool."""
    if not max_queued_tokens or choice.prefill is None:
        return None
    queued = prefill_queue(choice.prefill, local)
    if queued < max_queued_tokens:
        return None
    return f"the prefill pool has {queued} prompt tokens queued (bound {max_queued_tokens})"


def compatible(p: WorkerRecord, d: WorkerRecord) -> bool:
    return p.fingerprint == d.fingerprint


def unpaired(workers: Sequence[WorkerRecord]) -> list[str]:
    """Each decode worker that no prefill worker can feed, with why in words: its
    requests prefill on it alone, and operators should see that rather than infer it
    from latency. [] when every decode worker has a partner, or there is no prefill
    worker at all (a decode-only stack is not a mismatch)."""
    prefills = [w for w in workers if w.role == "prefill"]
    out = []
    for d in (w for w in workers if w.role == "decode"):
        if prefills and not any(compatible(p, d) for p in prefills):
            why = "; ".join(f"{p.worker_id}: {', '.join(layout_differences(p, d))}"
                            for p in prefills)
            out.append(f"decode worker {d.worker_id} has no prefill worker with its KV "
                       f"layout, so it prefills its own requests ({why})")
    return out


class RoundRobin:
    """The baseline: each pool in turn, ignoring load (capacity is still respected)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = {"prefill": 0, "decode": 0}

    def _take(self, pool: str, workers: Sequence[WorkerRecord]) -> WorkerRecord | None:
        if not workers:
            return None
        i = self._next[pool] % len(workers)
        self._next[pool] = i + 1
        return sorted(workers, key=lambda w: w.worker_id)[i]

    def choose(self, prefills: Sequence[WorkerRecord], decodes: Sequence[WorkerRecord],
               req: RouteInput, local: LocalLoad) -> Choice | None:
        d = self._take("decode", [d for d in decodes if decode_has_room(d, local)])
        if d is None:
            return None
        p = self._take("prefill", [p for p in prefills if compatible(p, d)])
        return Choice(p, d, self.name) if p is not None else Choice(None, d, "local_no_prefill")


@dataclass
class LoadAware:
    """Prefill by queued prompt tokens (minus cached prefix), decode by KV usage and
    running sequences, chosen jointly with the cost of moving the KV between hosts and
    into the decode worker's cache (minus the prefix it caches already).

    With the approximate prefix index the prefill worker holding the longest prefix
    wins outright unless saturated (`_prefix_holder`). With the precise one (the
    engines' own KV events) every pair is scored by one cost: what the hits save is
    known, so it is weighed against load rather than trusted blindly."""

    transfer_cost_tokens: int = 256  # a cross-host transfer costs like this many prompt tokens
    decode_weight_tokens: int = 512  # a fully loaded decode worker costs like this many
    local_prefill_max_tokens: int = 0  # prompts up to this long prefill on the decode worker
    saturated_queue_tokens: int = 8192  # prefill pool saturated above this queue per worker
    # taking one prompt token's KV into the decode worker's cache, in prefilled tokens
    transfer_token_weight: float = 0.1
    name: str = "load"

    def prefill_cost(self, p: WorkerRecord, req: RouteInput, local: LocalLoad) -> int:
        return prefill_queue(p, local) + max(0, req.prompt_len - req.prefix_hits.get(
            p.worker_id, 0))

    def transfer_cost(self, p: WorkerRecord, d: WorkerRecord, req: RouteInput) -> float:
        """Moving the prompt's KV from `p` to `d`: the prompt tokens `d` does not cache,
        weighted, plus the cross-host cost."""
        uncached = max(0, req.prompt_len - req.decode_hits.get(d.worker_id, 0))
        return (self.transfer_token_weight * uncached
                + (0 if p.host == d.host else self.transfer_cost_tokens))

    def decode_cost(self, d: WorkerRecord, local: LocalLoad) -> float:
        busy = d.load.running + d.load.waiting + local.requests(d)
        return self.decode_weight_tokens * max(busy / max(d.capacity, 1), d.load.kv_usage)

    def choose(self, prefills: Sequence[WorkerRecord], decodes: Sequence[WorkerRecord],
               req: RouteInput, local: LocalLoad) -> Choice | None:
        open_decodes = [d for d in decodes if decode_has_room(d, local)]
        if not open_decodes:
            return None
        best_decode = min(open_decodes, key=lambda d: self.decode_cost(d, local))
        if req.prompt_len <= self.local_prefill_max_tokens:
            return Choice(None, best_decode, "local_short_prompt")
        if not req.precise:
            prefix = self._prefix_holder(prefills, open_decodes, req, local)
            if prefix is not None:
                return prefix
        # Among equal costs the pair caching more wins: its saving is certain, while a
        # load report may still count a prompt that has finished since (a heartbeat late).
        best: tuple[tuple[float, int], WorkerRecord, WorkerRecord] | None = None
        for d in open_decodes:
            for p in prefills:
                if not compatible(p, d):
                    continue
                cost = (self.prefill_cost(p, req, local) + self.decode_cost(d, local)
                        + self.transfer_cost(p, d, req))
                key = (cost, -req.prefix_hits.get(p.worker_id, 0)
                       - req.decode_hits.get(d.worker_id, 0))
                if best is None or key < best[0]:
                    best = (key, p, d)
        if best is None:
            return Choice(None, best_decode, "local_no_prefill")
        _, p, d = best
        if self.local_prefill_max_tokens and prefill_queue(p, local) > self.saturated_queue_tokens:
            return Choice(None, best_decode, "local_prefill_saturated")
        if req.precise and req.prefix_hits.get(p.worker_id, 0):
            return Choice(p, d, "prefix")
        if req.precise and req.decode_hits.get(d.worker_id, 0):
            return Choice(p, d, "decode_prefix")
        return Choice(p, d, "load")

    def _prefix_holder(self, prefills: Sequence[WorkerRecord], decodes: list[WorkerRecord],
                       req: RouteInput, local: LocalLoad) -> Choice | None:
        """The worker holding the longest cached prefix wins unless its queue is
        saturated: load reports lag by up to a heartbeat, so weighing a cache hit against
        a queue that may already be gone would send the prompt elsewhere too often."""
        holders = [p for p in prefills if req.prefix_hits.get(p.worker_id, 0) > 0
                   and prefill_queue(p, local) < self.saturated_queue_tokens]
        if not holders:
            return None
        p = max(holders, key=lambda w: (req.prefix_hits[w.worker_id], -prefill_queue(w, local)))
        fits = [d for d in decodes if compatible(p, d)]
        if not fits:
            return None
        d = min(fits, key=lambda d: self.decode_cost(d, local) + self.transfer_cost(p, d, req))
        return Choice(p, d, "prefix")


@dataclass(slots=True)
class AdapterOverlay:
    """The LoRA loads and unloads this router made on each worker that the worker's last
    registry report may not show yet (as `LocalLoad` for requests): a change counts until
    a report written after it arrives, so a request right after a load finds the adapter
    where it was loaded, and one right after an unload does not. A worker without reports
    (the local pair's fixed view) is known by these changes alone."""

    # worker id -> adapter name -> (folder, or None when unloaded; time.time() of it)
    changes: dict[str, dict[str, tuple[str | None, float]]] = field(default_factory=dict)

    def loaded(self, worker_id: str, name: str, path: str) -> None:
        self.changes.setdefault(worker_id, {})[name] = (path, time.time())

    def unloaded(self, worker_id: str, name: str) -> None:
        self.changes.setdefault(worker_id, {})[name] = (None, time.time())

    def held(self, w: WorkerRecord) -> dict[str, str]:
        """The adapters `w` holds: name -> folder."""
        out = w.adapters
        for name, (path, at) in self.changes.get(w.worker_id, {}).items():
            if at < w.updated:
                continue  # the report was written after the change: it shows it
            if path is None:
                out.pop(name, None)
            else:
                out[name] = path
        return out

    def prune(self, workers: Sequence[WorkerRecord]) -> None:
        """Forget the changes of workers gone from the view, and those their reports show."""
        updated = {w.worker_id: w.updated for w in workers}
        for worker_id in list(self.changes):
            if worker_id not in updated:
                del self.changes[worker_id]
                continue
            mine = self.changes[worker_id]
            for name in [n for n, (_, at) in mine.items() if at < updated[worker_id]]:
                del mine[name]
            if not mine:
                del self.changes[worker_id]


@dataclass(frozen=True, slots=True)
class AdapterPlan:
    """A pair for a request under a LoRA adapter, and which of its workers must load the
    adapter first (none when both hold it)."""

    choice: Choice
    load: tuple[WorkerRecord, ...] = ()


def choose_with_adapter(policy: Policy, prefills: Sequence[WorkerRecord],
                        decodes: Sequence[WorkerRecord], req: RouteInput, local: LocalLoad,
                        holds: Callable[[WorkerRecord], bool]) -> AdapterPlan | None:
    """The pair for a request that runs under an adapter: prefill and decode of it must
    run under the same adapter (the KV depends on it), so pairs whose workers both hold
    it come first. When no such pair has room, or holders cannot make a full pair while
    a prefill pool exists, the policy chooses among all workers and the plan names the
    chosen workers that must load the adapter first. None: no decode worker has room."""
    held_p = [p for p in prefills if holds(p)]
    held_d = [d for d in decodes if holds(d)]
    if held_d:
        choice = policy.choose(held_p, held_d, req, local)
        # A pair of holders; or the decode worker alone, where no prefill worker exists
        # anyway, or the policy chose to prefill there (a short prompt).
        if choice is not None and (choice.prefill is not None or not prefills
                                   or not choice.reason.startswith("local_no_prefill")):
            return AdapterPlan(choice)
    choice = policy.choose(prefills, decodes, req, local)
    if choice is None:
        return None
    load = tuple(w for w in (choice.prefill, choice.decode) if w is not None and not holds(w))
    return AdapterPlan(choice, load)


def make_policy(name: str, local_prefill_max_tokens: int = 0,
                transfer_token_weight: float = 0.1) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "load":
        return LoadAware(local_prefill_max_tokens=local_prefill_max_tokens,
                         transfer_token_weight=transfer_token_weight)
    raise ValueError(f"unknown routing policy {name!r}; use round_robin or load")
