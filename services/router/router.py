"""The router: the public API in front of pools of prefill and decode workers.

Each request is admitted (bounded in-flight count, per-client leases), routed (a policy
picks the pair from the worker view plus this router's own in-flight counts and the
prefix index), then run as prefill -> decode (`orchestrator.run_pair`). The view is
Redis's registry for `pdserve router`, or the fixed local pair for `serve --mode
disagg`: one implementation of pair choice and conditional disaggregation for both.
Each step of a request is told to its `RequestEvents` (`events`), whose listeners keep
the span, the metrics and the timings, so this module is the request's control flow.
Router replicas keep no state of their own beyond what is in flight: any of them can
serve any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
from prometheus_client import Counter, Gauge

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.api.models import ServedModel
from services.engine.engine import ModelFacts
from services.engine.lora import check_name
from services.errors import (
    FailedCall,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PdserveError,
    Unavailable,
    WorkerFailure,
    from_worker_status,
)
from services.messages import Delta, GenerationRequest
from services.registry.leases import Lease
from services.registry.records import WorkerRecord
from services.router.catalog import Catalog
from services.router.config import RouterConfig
from services.router.events import RequestEvents, request_events
from services.router.kv_index import KVEventFeeds, KVIndex
from services.router.orchestrator import Peer, run_pair
from services.router.policies import (
    AdapterOverlay,
    Choice,
    LocalLoad,
    Policy,
    RouteInput,
    choose_with_adapter,
    make_policy,
    prefill_pool_full,
    unpaired,
)
from services.router.prefix import PrefixHints, block_hashes
from services.router.view import WorkerView
from services.router.watchdog import Liveness, answers
from services.security.tls import TLSFiles
from services.server.channels import dial

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SUSPECT_S = 2.0  # a worker that just failed a call is skipped this long (then doubling)
SUSPECT_MAX_S = 30.0  # ... and then until it answers a health probe
LORA_CALL_TIMEOUT_S = 120.0  # loading an adapter reads its folder and copies its weights

LORA_LOADS = Counter("pdserve_router_lora_loads", "LoRA adapter loads this router made on "
                     "workers, by why: a request's pair lacked it (request) or a load call "
                     "(admin)", ["reason"])
# The prefix index in use: precise (every worker's engine publishes its KV events),
# approximate (none does: where prompts were sent, from Redis) or mixed.
INDEX_MODES = ("precise", "approximate", "mixed")
PREFIX_INDEX_MODE = Gauge("pdserve_router_prefix_index_mode", "the prefix index this router "
                          "routes on: 1 for the mode in use (precise: the engines' KV events; "
                          "approximate: where prompts were sent; mixed: some of each)",
                          ["mode"])
# Hit rate per pool = cached / routed: the prompt tokens the chosen worker of the pool
# holds already, as the index knows it, over the prompt tokens routed to that pool.
ROUTED_PROMPT_TOKENS = Counter("pdserve_router_routed_prompt_tokens", "prompt tokens of "
                               "requests routed, by the pool of the worker that takes them "
                               "(decode: only where its cache is known)", ["pool"])
CACHED_PROMPT_TOKENS = Counter("pdserve_router_cached_prompt_tokens", "of those, the tokens "
                               "the chosen worker of the pool caches already, by the prefix "
                               "index", ["pool"])
LOAD_LORA_METHOD = "/pdserve.v1.DecodeService/LoadLoraAdapter"
UNLOAD_LORA_METHOD = "/pdserve.v1.DecodeService/UnloadLoraAdapter"


class RouterBackend:
    mode = "disaggregated"

    def __init__(self, config: RouterConfig, view: WorkerView,
                 tokenizer: PreTrainedTokenizerBase, model_path: str, fault: str = "", *,
                 tls: TLSFiles | None = None,
                 models: Sequence[tuple[str, PreTrainedTokenizerBase, str]] = ()) -> None:
        """`tokenizer` and `model_path` are the one model's, served under the name its
        workers register; or `models` lists every model served, as (name, tokenizer,
        folder), the default first, and the router routes each request among the
        workers of the model it names."""
        self.config = config
        self.tls = tls  # the internal mTLS identity workers are dialled with (None: plaintext)
        self.view = view
        self.models = Catalog(models) if models else Catalog.one(tokenizer, model_path)
        self.policy: Policy = make_policy(config.policy, config.local_prefill_max_tokens,
                                          config.transfer_token_weight)
        self.local = LocalLoad()
        self.adapters = AdapterOverlay()  # LoRA loads and unloads not yet in the view
        self.inflight = 0
        self.fault = fault  # fault injection on every request (tests; workers must allow)
        self._view: list[WorkerRecord] = []
        self._unpaired: list[str] = []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: dict[tuple[str, str], Peer] = {}  # (worker id, address) -> its calls
        self._refresher: asyncio.Task[None] | None = None
        # Workers that just failed a call: skipped for a pause, then until they answer a
        # health probe (`_recheck_forever`), leave the view, or finish a request.
        self._suspects: dict[str, tuple[float, int]] = {}  # id -> (until, failures)
        self._rechecker: asyncio.Task[None] | None = None
        self._empty_since = float("inf")
        self.liveness = Liveness(config.stream_silence_s, config.probe_timeout_s)
        self.prefix_hints = PrefixHints(view)
        self.kv_index = KVIndex()  # what each engine caches, from its KV events
        self.kv_feeds = KVEventFeeds(self.kv_index, self.peer)
        self.index_mode = ""

    # -- the worker view --------------------------------------------------------------
    async def start(self, wait_for_workers_s: float = 600.0) -> None:
        """Read the view until a decode worker is there, then keep refreshing."""
        deadline = time.monotonic() + wait_for_workers_s
        while True:
            try:
                await self.refresh()
            except Exception as e:  # Redis not up yet: keep waiting
                log.debug("worker view not readable yet: %s", e)
            waiting = self.models.without_decode(self._view)
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("no decode worker registered in Redis"
                                   + (f" for model {', '.join(map(repr, waiting))}"
                                      if waiting != [""] else ""))
            await asyncio.sleep(self.config.refresh_s)
        self._refresher = asyncio.create_task(self._refresh_forever())
        self._rechecker = asyncio.create_task(self._recheck_forever())

    async def refresh(self) -> None:
        view = await self.view.workers()
        if not view and self._empty_since == float("inf"):
            self._empty_since = time.monotonic()
        if not view and self._view and time.monotonic() < self._empty_since + 10.0:
            # An empty registry right after a full one is most likely Redis restarted
            # and not yet refilled by heartbeats: keep routing on the last view a while.
            return
        if view:
            self._empty_since = float("inf")
        self._view = view
        self.adapters.prune(view)
        self.kv_feeds.sync(view)
        self._set_index_mode()
        self.models.learn(view)
        # Per model: a decode worker is unpaired only when no prefill worker of its own
        # model can feed it (another model's never could).
        problems = [line for m in self.models.facts
                    for line in unpaired(self.models.pool(view, m))]
        if problems != self._unpaired:  # once per change, not per refresh
            self._unpaired = problems
            for line in problems:
                log.warning("%s", line)

    def _set_index_mode(self) -> None:
        tracked = [self.kv_index.tracking(w.worker_id) for w in self._view]
        mode = ("precise" if tracked and all(tracked) else "mixed" if any(tracked)
                else "approximate")
        if mode != self.index_mode:
            if self.index_mode:
                log.info("prefix index: %s (was %s)", mode, self.index_mode)
            self.index_mode = mode
            for m in INDEX_MODES:
                PREFIX_INDEX_MODE.labels(m).set(1 if m == mode else 0)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            try:
                await self.refresh()
            except Exception as e:  # Redis away: keep routing on the last view
                log.warning("worker view refresh failed (%s); using the last view", e)

    async def _recheck_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            try:
                await self.recheck_suspects()
            except Exception:  # never let the loop die: suspects would stay out for good
                log.exception("re-probing suspect workers failed")

    async def recheck_suspects(self) -> None:
        """Probe each suspect whose pause is over: one that answers is back in rotation,
        one that does not (hung, or dead and not yet expired from the registry) is paused
        again, longer. A worker is never sent requests only to find it hung again."""
        now = time.monotonic()
        due = [w for w in self._view if self._suspects.get(w.worker_id, (now, 0))[0] < now]
        for worker_id in set(self._suspects) - {w.worker_id for w in self._view}:
            del self._suspects[worker_id]  # gone from the registry: nothing to route to
        if not due:
            return
        timeout = self.config.probe_timeout_s
        answered = await asyncio.gather(*(answers(self.peer(w).channel, timeout) for w in due))
        for w, ok in zip(due, answered, strict=True):
            if ok:
                self._suspects.pop(w.worker_id, None)
            elif w.worker_id in self._suspects:
                log.warning("worker %s still does not answer a health probe; kept out of "
                            "rotation", w.worker_id)
                self._suspect(w.worker_id)

    async def close(self) -> None:
        for task in (self._refresher, self._rechecker):
            if task is not None:
                task.cancel()
        await self.prefix_hints.close()
        await self.kv_feeds.close()
        for channel in self._channels.values():
            await channel.close()

    def peer(self, w: WorkerRecord) -> Peer:
        key = (w.worker_id, w.address)
        peer = self._peers.get(key)
        if peer is None:
            if w.address not in self._channels:
                self._channels[w.address] = dial(w.address, self.tls)
            peer = self._peers[key] = Peer(w.worker_id, self._channels[w.address])
        return peer

    @property
    def facts(self) -> ModelFacts:
        """The default model's."""
        assert self.models.facts, "start() first"
        return self.models.facts[self.models.default]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The default model's."""
        return self.models.tokenizer(self.models.default)

    def served_models(self) -> list[ServedModel]:
        """Each model some worker of registered, the default first, with the adapters its
        workers hold."""
        return [ServedModel(self.models.facts[m], self.models.tokenizer(m),
                            self._adapters_of(m))
                for m in self.models.sources if m in self.models.facts]

    def _pool(self, key: str) -> list[WorkerRecord]:
        """The workers of the model under `key` (`Catalog.key`), in rotation or not."""
        return self.models.pool(self._view, key)

    # -- requests ---------------------------------------------------------------------
    def _reject(self, events: RequestEvents, reason: str, message: str) -> Overloaded:
        error = Overloaded(message, self.config.retry_after_ms)
        events.rejected(reason, error.message)
        return error

    def _live(self, role: str, model: str = "") -> list[WorkerRecord]:
        """The workers of `role` in rotation that serve `model` ("" = the default): pairs
        are chosen among one model's workers only, never across models."""
        return [w for w in self._pool(self.models.key(model))
                if w.role == role and w.worker_id not in self._suspects]

    def _suspect(self, worker_id: str) -> None:
        """Take a worker out of rotation at once: it refused a connection, broke a stream
        or hung. Only worker failures get here, never a client's error. The time out
        doubles with each failure in a row (a worker that stays dead is not retried by
        every request), up to SUSPECT_MAX_S; a success clears it."""
        _, failures = self._suspects.get(worker_id, (0.0, 0))
        pause = min(SUSPECT_S * 2 ** failures, SUSPECT_MAX_S)
        self._suspects[worker_id] = (time.monotonic() + pause, failures + 1)

    # -- LoRA adapters ----------------------------------------------------------------
    def adapter_paths(self) -> dict[str, str]:
        """The adapters some live worker holds, of any model: name -> folder."""
        out: dict[str, str] = {}
        for m in self.models.facts:
            for name, path in self._adapters_of(m).items():
                out.setdefault(name, path)
        return dict(sorted(out.items()))

    def _adapters_of(self, model: str) -> dict[str, str]:
        """The adapters some live worker of `model` holds: name -> folder."""
        out: dict[str, str] = {}
        for w in self._pool(model):
            for name, path in self.adapters.held(w).items():
                out.setdefault(name, path)
        return dict(sorted(out.items()))

    async def _lora_call(self, w: WorkerRecord, method: str, request: object) -> None:
        call = self.peer(w).channel.unary_unary(
            method, request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=None)
        try:
            await call(request, timeout=LORA_CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            role = w.role
            raise from_worker_status(FailedCall(role, w.worker_id, e.code(),
                                                e.details() or "")) from e

    async def _load_on(self, workers: Sequence[WorkerRecord], name: str, path: str,
                       reason: str) -> None:
        """Load the adapter on each of `workers` at once; the first failure is raised
        (a worker that could not be reached is taken out of rotation)."""
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        results = await asyncio.gather(
            *(self._lora_call(w, LOAD_LORA_METHOD, request) for w in workers),
            return_exceptions=True)
        failure: BaseException | None = None
        for w, result in zip(workers, results, strict=True):
            if result is None:
                self.adapters.loaded(w.worker_id, name, path)
                LORA_LOADS.labels(reason).inc()
                continue
            if isinstance(result, WorkerFailure):
                self._suspect(w.worker_id)
            failure = failure or result
        if failure is not None:
            raise failure

    async def load_adapter(self, name: str, path: str) -> None:
        """Load an adapter on every worker of the default model in rotation (a request
        may pair any two), or on none: a folder one worker refuses is unloaded from those
        that took it."""
        check_name(name)
        if name in {f.name for f in self.models.facts.values()}:
            raise InvalidRequest(f"lora_name: {name!r} is a served base model's name; give "
                                 "the adapter another")
        if name in self.adapter_paths():
            raise InvalidRequest(f"lora_name: the LoRA adapter {name!r} is already loaded; "
                                 "unload it first to load it from another folder")
        # Adapters loaded at run time apply to the default model (vLLM's load call names
        # no base model).
        workers = [w for w in self._pool(self.models.default)
                   if w.worker_id not in self._suspects]
        if not workers:
            raise Unavailable("no worker is registered that could load the adapter")
        try:
            await self._load_on(workers, name, path, "admin")
        except BaseException:
            with contextlib.suppress(Exception):
                await self._unload_from(workers, name)
            raise

    async def _unload_from(self, workers: Sequence[WorkerRecord], name: str) -> int:
        """Unload from each of `workers` that holds it; returns how many did."""
        holders = [w for w in workers if name in self.adapters.held(w)]
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        results = await asyncio.gather(
            *(self._lora_call(w, UNLOAD_LORA_METHOD, request) for w in holders),
            return_exceptions=True)
        for w, result in zip(holders, results, strict=True):
            if result is None or isinstance(result, ModelNotFound):
                self.adapters.unloaded(w.worker_id, name)
        failures = [r for r in results if r is not None and not isinstance(r, ModelNotFound)]
        if failures:
            raise failures[0]
        return len(holders)

    async def unload_adapter(self, name: str) -> None:
        """Unload an adapter from every worker that holds it (`ModelNotFound`: none)."""
        check_name(name)
        if not await self._unload_from(self._view, name):
            raise ModelNotFound(f"lora_name: the LoRA adapter {name!r} cannot be found")

    async def _choose(self, req: GenerationRequest, hashes: list[str],
                      events: RequestEvents) -> Choice:
        model = self.models.served(req.model)
        prefills, decodes = self._live("prefill", model), self._live("decode", model)
        if not decodes:
            # The view is up to refresh_s old: a decode worker that just (re)started may
            # already be registered. One Redis read is cheap next to failing the request.
            with contextlib.suppress(Exception):
                await self.refresh()
            prefills, decodes = self._live("prefill", model), self._live("decode", model)
        if not decodes and prefills:
            # No decode worker can serve: a prefill worker runs whole requests (it is a
            # full engine), so the stack degrades instead of refusing.
            decodes, prefills = prefills, []
        if not decodes:
            which = f" of model {model!r}" if self.models.several else ""
            raise Unavailable(f"no worker{which} is registered that can serve the request; "
                              "retry shortly (workers may be restarting)")
        route = await self._route_input(req, prefills, decodes, hashes)
        if req.lora:
            choice = await self._choose_with_adapter(req, prefills, decodes, route, events)
        else:
            found = self.policy.choose(prefills, decodes, route, self.local)
            if found is None:
                raise self._reject(events, "capacity", "every decode worker is at capacity")
            if full := prefill_pool_full(found, self.local,
                                         self.config.prefill_max_queued_tokens):
                raise self._reject(events, "prefill_queue", full)
            choice = found
        _count_hits(choice, route)
        if choice.prefill is not None and route.decode_hits.get(choice.decode.worker_id):
            choice = replace(choice, reuse_tokens=route.decode_hits[choice.decode.worker_id])
        if choice.prefill is not None and route.prefix_hits.get(choice.prefill.worker_id):
            choice = replace(choice, prefill_cached=route.prefix_hits[choice.prefill.worker_id])
        return choice

    async def _route_input(self, req: GenerationRequest, prefills: list[WorkerRecord],
                           decodes: list[WorkerRecord], hashes: list[str]) -> RouteInput:
        """The request's facts for the policy: cached prefix tokens per worker, from the
        engines' KV events where a worker publishes them, else (prefill workers only)
        from the approximate index in Redis."""
        precise = self.kv_index.hits([w.worker_id for w in (*prefills, *decodes)],
                                     req.prompt_token_ids, req.lora)
        hits = {p.worker_id: precise[p.worker_id] for p in prefills if p.worker_id in precise}
        untracked = [p for p in prefills if p.worker_id not in precise]
        if hashes and untracked:
            try:
                approximate = await self.view.prefix_hits(hashes, self.config.prefix_block_size)
            except Exception as e:  # the index is an optimization: route without it
                log.warning("prefix lookup failed: %s", e)
            else:
                hits.update((w.worker_id, approximate[w.worker_id]) for w in untracked
                            if w.worker_id in approximate)
        decode_hits = {d.worker_id: precise[d.worker_id] for d in decodes
                       if d.worker_id in precise}
        return RouteInput(len(req.prompt_token_ids), hits, decode_hits,
                          precise=bool(prefills) and not untracked)

    async def _choose_with_adapter(self, req: GenerationRequest,
                                   prefills: list[WorkerRecord], decodes: list[WorkerRecord],
                                   route: RouteInput, events: RequestEvents) -> Choice:
        """A pair that holds the request's adapter, loading it where it is missing."""
        path = self._adapters_of(self.models.key(req.model)).get(req.lora)
        if path is None:
            raise ModelNotFound(f"model: {req.lora!r} is not served here (no worker holds "
                                "that LoRA adapter); GET /v1/models lists what is")
        plan = choose_with_adapter(self.policy, prefills, decodes, route, self.local,
                                   lambda w: req.lora in self.adapters.held(w))
        if plan is None:
            raise self._reject(events, "capacity", "every decode worker is at capacity")
        choice = plan.choice
        if full := prefill_pool_full(choice, self.local, self.config.prefill_max_queued_tokens):
            raise self._reject(events, "prefill_queue", full)
        if plan.load:
            try:
                await self._load_on(plan.load, req.lora, path, "request")
            except PdserveError as e:
                raise Unavailable(f"could not load LoRA adapter {req.lora!r} on the chosen "
                                  f"workers: {e.message}") from e
        return choice

    async def _admit(self, req: GenerationRequest, events: RequestEvents) -> Lease | None:
        """Let `req` in, with its client lease when clients are limited; a refusal, or
        a failure to ask Redis for the lease, ends the request's events."""
        try:
            if self.inflight >= self.config.max_inflight:
                raise self._reject(events, "router_queue",
                                   f"router has {self.inflight} requests in flight")
            limit = self.config.client_max_inflight
            if not (limit and req.client_id):
                return None
            lease = await self.view.acquire_client_lease(req.client_id, limit)
            if lease is None:
                raise self._reject(events, "client_limit", f"client {req.client_id!r} has "
                                   f"{limit} requests in flight")
            return lease
        except BaseException as e:
            events.failed(e)
            events.ended()
            raise

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """Serve `req` on a pair; when a worker fails, move the request to another one
        (up to `migration_limit` times): it continues from the prompt plus every token
        the client already has, with the budget that is left, so the client sees one
        unbroken stream. Greedy output is the same as without the failure."""
        facts = self.models.facts.get(self.models.key(req.model))
        events = request_events(req, facts.name if facts else "")
        lease = await self._admit(req, events)
        self.inflight += 1
        events.admitted(self.inflight)
        # KV computed under an adapter is its own: its prefix index entries too.
        hashes = block_hashes(req.prompt_token_ids, self.config.prefix_block_size,
                              salt=req.lora)
        streamed: list[int] = []  # every token the client has received
        moves = 0
        leg = req
        try:
            while True:
                choice = await self._choose(leg, hashes if not streamed else [], events)
                events.pair_chosen(moves, choice)
                try:
                    async for delta in self._run(leg, choice, hashes, events):
                        if delta.finished:
                            delta.migrations = moves
                            events.finished(delta, len(streamed) + len(delta.token_ids))
                        streamed += delta.token_ids
                        yield delta
                    return
                except WorkerFailure as e:
                    self._suspect(e.worker_id)
                    # n > 1 answers move only before their first token: a continuation
                    # carries one answer so far.
                    if moves >= self.config.migration_limit or (req.sampling.n > 1
                                                                 and streamed):
                        raise
                    moves += 1
                    events.moved(moves, e, len(streamed))
                    leg = req.continued(streamed)
                    if (done := self._finished_already(leg, streamed)) is not None:
                        done.migrations = moves
                        events.finished(done, len(streamed))
                        yield done
                        return
        except BaseException as e:
            events.failed(e)
            raise
        finally:
            self.inflight -= 1
            events.ended(self.inflight)
            if lease is not None:
                with contextlib.suppress(Exception):
                    await self.view.release_client_lease(lease)

    def _finished_already(self, leg: GenerationRequest, streamed: list[int]) -> Delta | None:
        """The worker broke after the answer's last token but before its final message:
        the answer is complete, so it is finished here rather than continued."""
        if leg.max_tokens <= 0:
            return Delta([], "", finished=True, finish_reason="length")
        facts = self.models.facts.get(self.models.key(leg.model))
        eos = facts.eos_token_ids if facts is not None else ()
        if (streamed and not leg.sampling.ignore_eos and streamed[-1] in eos
                and leg.sampling.min_tokens == 0):
            return Delta([], "", finished=True, finish_reason="stop")
        return None

    async def _run(self, req: GenerationRequest, choice: Choice, hashes: list[str],
                   events: RequestEvents) -> AsyncIterator[Delta]:
        p, d = choice.prefill, choice.decode
        tokens = len(req.prompt_token_ids)
        flights = [self.local.sent((p or d).worker_id, tokens, choice.prefill_cached)]
        if p is not None:
            flights.append(self.local.sent(d.worker_id, 0))
        target = wpb.KVTarget(worker_id=d.worker_id, epoch=d.epoch, kv_address=d.kv_address,
                              kv_transport=d.kv_transport, fingerprint_digest=d.fingerprint,
                              same_host=p is not None and p.host == d.host,
                              kv_addresses=d.kv_addresses)
        first = True
        try:
            async for delta in run_pair(req, self.peer(p) if p else None, self.peer(d),
                                        target, self.fault, self.liveness,
                                        events.grpc_metadata(),
                                        reuse_tokens=choice.reuse_tokens):
                if first:
                    first = False
                    self.local.prefilled(flights[0])
                    events.first_token()
                    # The approximate index, for workers whose engines do not tell.
                    if p is not None and hashes and not self.kv_index.tracking(p.worker_id):
                        self.prefix_hints.record(p.worker_id, hashes)
                if delta.finished:
                    for w in (p, d):
                        if w is not None:
                            self._suspects.pop(w.worker_id, None)
                yield delta
        finally:
            for flight in flights:
                self.local.done(flight)


def _count_hits(choice: Choice, route: RouteInput) -> None:
    """The hit-rate counters of each pool the request takes: the prefill pool's (or the
    decode worker's own, when it prefills), and the decode pool's where its cache is
    known."""
    prompt = route.prompt_len
    if choice.prefill is not None:
        ROUTED_PROMPT_TOKENS.labels("prefill").inc(prompt)
        CACHED_PROMPT_TOKENS.labels("prefill").inc(
            min(prompt, route.prefix_hits.get(choice.prefill.worker_id, 0)))
    cached = route.decode_hits.get(choice.decode.worker_id)
    if cached is not None:
        ROUTED_PROMPT_TOKENS.labels("decode").inc(prompt)
        CACHED_PROMPT_TOKENS.labels("decode").inc(min(prompt, cached))
