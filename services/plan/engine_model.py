"""A pure model of one vLLM engine's scheduler (v1, chunked prefill on), stepped by the
fleet simulation. No clock of its own: the caller says when a step starts.

Each step, as vLLM's scheduler does: every running decoding sequence gets one token; the
rest of the token budget (``max_num_batched_tokens``) goes to prompts already being
prefilled, in admission order, then to waiting requests in arrival order, while fewer than
``max_num_seqs`` are running and the KV cache has room; a prompt that does not fit the
budget is split into chunks over several steps, and none gets more than
``long_prefill_token_threshold`` tokens of a step while another request is in the
engine. A request emits a token at the end of the step that computes the last chunk of
its prompt, then one per step.

A shipped request (``submit_remote``) waits one step more, as vLLM's asynchronous KV
load does: the connector finds its KV complete at the start of a step, copies it into the
paged cache during that step (the step is longer by the copy's CPU, ``handoff_s``) and
reports it at its end, and the scheduler schedules the request in the next step. An idle
engine notices it at once (its empty polling steps cost next to nothing).

With a prefix cache (``EngineSim.cache``, prefix_cache.py), a request admitted from the
waiting queue first looks up its prompt's whole blocks there, as vLLM does when it
schedules a request: the leading blocks found are context, not computed (at least one
token is always computed), and every block a step completes is cached at the step's end.
A shipped request's blocks are cached when its KV has loaded.

Two simplifications, both exact while the KV cache is not the bottleneck: a request
reserves KV for its whole length (prompt + output) when admitted, so nothing is ever
preempted (vLLM admits on the prompt and preempts on overflow); and the engine's step
time is the cost model's, with no noise.

Decoding sequences are kept lazily: a sequence that joined the decode set after step j
and must emit r more tokens leaves after step j + r, and the sum of their contexts grows
by the number of decoders each step, so a decode step costs O(1) however large the batch.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from services.plan.costmodel import StepCost, chunk_attention
from services.plan.prefix_cache import PrefixCache


@dataclass(slots=True, frozen=True)
class EngineLimits:
    """The scheduler's limits (vLLM's names)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    kv_cache_tokens: int
    long_prefill_token_threshold: int = 0  # 0: no cap on one prompt's tokens per step

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("the step budget and max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.kv_cache_tokens < 1:
            raise ValueError("the KV cache must hold at least one token")


@dataclass(slots=True, eq=False)
class Job:
    """A request as one engine sees it."""

    rid: int
    prompt: int  # tokens this engine computes before it emits (1 for a shipped request)
    out: int  # tokens this engine emits
    context: int = 0  # tokens already in its KV cache (a shipped request's prompt less one)
    handoff_s: float = 0.0  # stall added to the step that first schedules it
    blocks: tuple[bytes, ...] = ()  # chained keys of the prompt's whole blocks (prefix_cache.py)
    stored: int = 0  # of ``blocks``, those this engine holds for it
    computed: int = 0
    scheduled_at: float = -1.0  # when a step first scheduled it
    join: int = -1  # the step whose end emitted its first token here
    finish: int = -1  # the step whose end emitted its last token here

    @property
    def length(self) -> int:
        return self.context + self.prompt + self.out


@dataclass(slots=True)
class EngineSim:
    """One engine: a waiting queue, the sequences running, and the step in flight."""

    cost: StepCost
    limits: EngineLimits
    name: str = "engine"
    waiting: deque[Job] = field(default_factory=deque)
    prefilling: list[Job] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)  # end time of every finished step
    kv_used: int = 0
    queued_tokens: int = 0  # prompts waiting or being prefilled (what a worker reports)
    decoders: int = 0
    _dec_ctx_sum: int = 0  # contexts of the decoders at the next step
    _finish_heap: list[tuple[int, int, Job]] = field(default_factory=list)
    _sched: list[tuple[Job, int]] = field(default_factory=list)
    _step_decoders: int = 0
    step_end: float | None = None  # end of the step in flight; None when idle
    busy_s: float = 0.0
    landed: list[Job] = field(default_factory=list)  # shipped KV here, not yet noticed
    loading: list[Job] = field(default_factory=list)  # noticed by the step in flight
    cache: PrefixCache | None = None  # None: no prefix caching
    block_tokens: int = 0  # tokens one key of ``Job.blocks`` stands for
    computed_tokens: int = 0  # prompt tokens computed here (vLLM's local_compute)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache

    @property
    def running(self) -> int:
        return self.decoders + len(self.prefilling)

    @property
    def requests(self) -> int:
        """Requests in the engine: running, waiting, or waiting for their KV to load."""
        return self.running + len(self.waiting) + len(self.landed) + len(self.loading)

    def submit(self, job: Job) -> None:
        if job.length > self.limits.kv_cache_tokens:
            raise ValueError(f"request {job.rid} ({job.length} tokens) can never fit the "
                             f"KV cache of {self.limits.kv_cache_tokens} tokens")
        self.waiting.append(job)
        self.queued_tokens += job.prompt

    def submit_remote(self, job: Job) -> None:
        """A shipped request whose KV has landed: schedulable after the step that loads it
        (module doc), at once on an idle engine."""
        if self.step_end is None:
            self.submit(job)
        else:
            self.landed.append(job)

    def start_step(self, now: float) -> float | None:
        """Schedules the next step at ``now``; returns its end, or None with no work."""
        assert self.step_end is None, "a step is already in flight"
        budget = self.limits.max_num_batched_tokens - self.decoders
        sched: list[tuple[Job, int]] = []
        tokens, attention, stall = 0, 0.0, 0.0
        self.loading, self.landed = self.landed, []
        for job in self.loading:  # copied into the paged cache during this step
            stall += job.handoff_s
            job.handoff_s = 0.0
        # vLLM lifts the cap when one request is all the engine has: nobody to starve.
        cap = self.limits.long_prefill_token_threshold
        if not cap or self.running + len(self.waiting) <= 1:
            cap = budget
        for job in self.prefilling:
            if budget <= 0:
                break
            chunk = min(job.prompt - job.computed, budget, cap)
            sched.append((job, chunk))
            budget -= chunk
        while self.waiting and budget > 0 and self.running < self.limits.max_num_seqs:
            job = self.waiting[0]
            if self.kv_used + job.length > self.limits.kv_cache_tokens:
                break  # head of line waits for KV room, as vLLM's FCFS queue does
            self.waiting.popleft()
            self.kv_used += job.length
            self._reuse(job)
            self.prefilling.append(job)
            job.scheduled_at = now
            stall += job.handoff_s
            chunk = min(job.prompt, budget, cap)
            sched.append((job, chunk))
            budget -= chunk
        if not sched and not self.decoders and not self.loading:
            return None
        for job, chunk in sched:
            tokens += chunk
            attention += chunk_attention(chunk, job.context + job.computed)
        context = self._dec_ctx_sum / 1e6 if self.decoders else 0.0
        duration = self.cost.step_s(tokens, self.decoders, attention, context) + stall
        self._sched, self._step_decoders = sched, self.decoders
        self.step_end = now + duration
        self.busy_s += duration
        return self.step_end

    def finish_step(self) -> tuple[list[Job], list[Job]]:
        """Ends the step in flight: returns (jobs that emitted their first token here,
        jobs that emitted their last). A job with one token to emit is in both."""
        assert self.step_end is not None, "no step in flight"
        step = len(self.ends)
        self.ends.append(self.step_end)
        self.step_end = None
        self._dec_ctx_sum += self._step_decoders
        firsts: list[Job] = []
        done: list[Job] = []
        while self._finish_heap and self._finish_heap[0][0] == step:
            _, _, job = heapq.heappop(self._finish_heap)
            self.decoders -= 1
            self._dec_ctx_sum -= job.context + job.prompt + 1 + (step - job.join)
            self.kv_used -= job.length
            done.append(job)
        for job, chunk in self._sched:
            job.computed += chunk
            self.computed_tokens += chunk
            if self.block_tokens:
                self._store(job, (job.context + job.computed) // self.block_tokens)
            if job.computed < job.prompt:
                continue
            self.queued_tokens -= job.prompt
            self.prefilling.remove(job)
            job.join = step
            firsts.append(job)
            if job.out <= 1:
                job.finish = step
                self.kv_used -= job.length
                done.append(job)
            else:
                job.finish = step + job.out - 1
                self.decoders += 1
                self._dec_ctx_sum += job.context + job.prompt + 1
                heapq.heappush(self._finish_heap, (job.finish, job.rid, job))
        self._sched = []
        for job in self.loading:  # reported loaded: the next step may schedule it
            self._store(job, len(job.blocks))
            self.submit(job)
        self.loading = []
        return firsts, done

    def _reuse(self, job: Job) -> None:
        """A fresh prompt admitted: its leading blocks found in the cache become context."""
        if self.cache is None or not job.blocks or job.context or job.computed:
            return
        found = self.cache.match(job.blocks)
        cached = min(found * self.block_tokens, job.prompt - 1)
        job.stored = found
        if cached > 0:
            job.prompt -= cached
            job.context += cached
            self.queued_tokens -= cached
            self.cached_tokens += cached

    def _store(self, job: Job, blocks: int) -> None:
        """The job's first ``blocks`` blocks are in this engine's KV: cache them."""
        if self.cache is not None and blocks > job.stored:
            self.cache.insert(job.blocks[job.stored:blocks])
            job.stored = blocks

    def token_times(self, job: Job) -> list[float]:
        """When each of the job's tokens left this engine (its steps' ends)."""
        return self.ends[job.join: job.finish + 1]
