"""The router's own policies (services/router/policies.py) deciding for the fleet
simulation: each simulated engine is drawn as the worker record a router would see, with
its load as of the decision and, per index, the prefix hits the router would be told.

Indexes, as the router builds them:
  * ``round_robin``: no index; each pool in turn.
  * ``approximate``: the load policy on the prefix index of which prefill worker was
    sent a prompt's blocks (written when the prompt's first token comes back); decode
    workers' caches are not seen, so every block is shipped.
  * ``precise``: the load policy on the engines' own caches (their KV events), both
    pools; the blocks the decode worker holds are not shipped.
Load reports are taken as current (the router's heartbeat lag is left out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.registry.records import WorkerLoad, WorkerRecord
from services.router.policies import LoadAware, LocalLoad, Policy, RoundRobin, RouteInput

ROUTINGS = ("round_robin", "approximate", "precise")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a worker's load report says of its engine."""

    waiting: int
    running: int
    queued_prompt_tokens: int
    kv_usage: float


@dataclass(frozen=True, slots=True)
class Route:
    """The router's answer: indexes into the pools (prefill None: prefill on the decode
    worker) and the prompt tokens whose KV the decode worker holds (not shipped)."""

    prefill: int | None
    decode: int
    reuse_tokens: int = 0


class RouterModel:
    """One router of ``routing`` (``ROUTINGS``) over the simulated pools."""

    def __init__(self, routing: str, max_num_seqs: int, local_prefill_max_tokens: int = 0,
                 saturated_queue_tokens: int = 8192) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; use one of {', '.join(ROUTINGS)}")
        self.routing, self.capacity = routing, max_num_seqs
        self.policy: Policy = (RoundRobin() if routing == "round_robin" else
                               LoadAware(local_prefill_max_tokens=local_prefill_max_tokens,
                                         saturated_queue_tokens=saturated_queue_tokens))
        self._local = LocalLoad()  # reports are current: nothing unreported

    def _records(self, role: str, loads: Sequence[EngineLoad]) -> list[WorkerRecord]:
        return [WorkerRecord(worker_id=f"{role}-{i:05d}", role=role, address="", host="sim",
                             epoch=0, fingerprint="sim", capacity=self.capacity,
                             load=WorkerLoad(waiting=w.waiting, running=w.running,
                                             queued_prompt_tokens=w.queued_prompt_tokens,
                                             kv_usage=w.kv_usage))
                for i, w in enumerate(loads)]

    def choose(self, prompt_len: int, prefills: Sequence[EngineLoad],
               decodes: Sequence[EngineLoad], prefix_hits: Mapping[int, int],
               decode_hits: Mapping[int, int]) -> Route | None:
        """The pair for one prompt; ``prefix_hits``/``decode_hits``: cached prompt tokens
        per engine index, as the index in use reports them (left empty where it reports
        nothing). None: no decode worker has room (the router rejects the request)."""
        ps, ds = self._records("prefill", prefills), self._records("decode", decodes)
        precise = self.routing == "precise"
        route = RouteInput(prompt_len,
                           {ps[i].worker_id: n for i, n in prefix_hits.items()},
                           {ds[i].worker_id: n for i, n in decode_hits.items()} if precise
                           else {},
                           precise=precise and bool(ps))
        choice = self.policy.choose(ps, ds, route, self._local)
        if choice is None:
            return None
        d = ds.index(choice.decode)
        if choice.prefill is None:
            return Route(None, d)
        return Route(ps.index(choice.prefill), d,
                     route.decode_hits.get(choice.decode.worker_id, 0))
