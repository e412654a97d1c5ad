"""The precise prefix index fed by real engines' KV cache events, watched over each
worker's gRPC port: two prefill workers and one decode worker (real vLLM engines,
standalone processes), a real redis-server, and a router in this process so its index can
be read directly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from services.messages import GenerationRequest, Sampling
from services.registry.records import WorkerRecord
from services.registry.redis_server import RedisServer
from services.registry.registry import Registry
from services.registry.signing import RecordSigner
from services.router.config import RouterConfig
from services.router.kv_index import EVENTS
from services.router.policies import Choice
from services.router.router import RouterBackend
from tests.helpers.prompts import prompt_of_length
from tests.helpers.servers import ServerProcess

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SECRET = "kv-events-tests-cluster-secret"
BLOCK = 128  # the CPU engines' KV block size


class Stack:
    def __init__(self, redis: RedisServer, workdir: Path) -> None:
        self.redis = redis
        self.workdir = workdir
        self.workers: dict[str, ServerProcess] = {}

    def worker(self, name: str, role: str, cores: str) -> ServerProcess:
        proc = ServerProcess(
            ["--redis-url", self.redis.url, "--worker-id", name, "--cpu-cores", cores,
             "--kv-cache-gib", "1", "--worker-ttl-s", "3"],
            self.workdir / f"kv-events-{name}-{len(self.workers)}.log", command=role,
            env={"PDSERVE_CLUSTER_SECRET": SECRET})
        proc.start()
        self.workers[name] = proc
        return proc

    def stop(self) -> None:
        for proc in self.workers.values():
            proc.stop()


@pytest.fixture(scope="module")
async def stack(redis: RedisServer, session_dir: Path, model_path: Path) -> AsyncIterator[Stack]:
    stack = Stack(redis, session_dir)
    try:
        stack.worker("events-prefill-a", "prefill", "0")
        stack.worker("events-prefill-b", "prefill", "0")
        stack.worker("events-decode", "decode", "1")
        await asyncio.gather(*(p.wait_ready(timeout=900) for p in stack.workers.values()))
        yield stack
    finally:
        stack.stop()


@pytest.fixture
async def router(stack: Stack, model_path: Path, tokenizer) -> AsyncIterator[RouterBackend]:  # type: ignore[no-untyped-def]
    registry = Registry.from_url(stack.redis.url, signer=RecordSigner(SECRET.encode()))
    backend = RouterBackend(RouterConfig(policy="load"), registry, tokenizer, str(model_path))
    try:
        await backend.start(60)
        await until(lambda: len(backend.kv_feeds.subscribed) == 3, "three workers followed")
        yield backend
    finally:
        await backend.close()
        await registry.close()


async def until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.1)


async def run(router: RouterBackend, ids: list[int], max_tokens: int = 4) -> list[int]:
    """Serve one greedy request through the router; its output tokens."""
    req = GenerationRequest(f"kv-events-{time.monotonic_ns()}", ids, Sampling(temperature=0.0),
                            max_tokens)
    out: list[int] = []
    async for delta in router.generate(req):
        out += delta.token_ids
    return out


def hits(router: RouterBackend, ids: list[int]) -> dict[str, int]:
    return router.kv_index.hits(router.kv_feeds.workers, ids)


async def choose(router: RouterBackend, ids: list[int]) -> Choice:
    req = GenerationRequest("choice", ids, Sampling(temperature=0.0), 1)
    return await router._choose(req, [], _NoEvents())


class _NoEvents:
    """The pair choice alone, with no request around it to report to."""

    def rejected(self, reason: str, message: str) -> None:
        raise AssertionError(f"refused: {reason}: {message}")


def records(router: RouterBackend) -> dict[str, WorkerRecord]:
    return {w.worker_id: w for w in router._view}


async def test_every_worker_publishes_and_stored_blocks_reach_the_index(
        router: RouterBackend, tokenizer) -> None:  # type: ignore[no-untyped-def]
    views = records(router)
    # Served on each worker's gRPC port: the record says so, and names no other port.
    assert all(w.kv_events for w in views.values()), views
    assert router.index_mode == "precise"
    ids = prompt_of_length(tokenizer, 5 * BLOCK + 40, salt="events reach the index")
    assert set(hits(router, ids).values()) == {0}
    await run(router, ids)
    # Both sides hold the prompt's full blocks: the prefill engine computed them, the
    # decode engine loaded them from the transfer.
    await until(lambda: sorted(hits(router, ids).values()) == [0, 5 * BLOCK, 5 * BLOCK],
                f"the prompt's blocks in the index: {hits(router, ids)}")
    assert hits(router, ids)["events-decode"] == 5 * BLOCK


async def test_a_second_turn_goes_to_the_prefill_worker_holding_its_prefix(
        router: RouterBackend, tokenizer) -> None:  # type: ignore[no-untyped-def]
    holders = set()
    for topic in ("the sea", "mountains"):
        first = prompt_of_length(tokenizer, 6 * BLOCK, salt=f"a conversation about {topic}")
        answer = await run(router, first, max_tokens=16)
        await until(lambda first=first: max(hits(router, first).values()) >= 6 * BLOCK,
                    "turn 1's blocks in the index")
        holder = next(w for w, n in hits(router, first).items()
                      if n >= 6 * BLOCK and records(router)[w].role == "prefill")
        holders.add(holder)
        # A second turn comes after the answer was read: by then the holder's load
        # report no longer counts turn 1's prompt as queued.
        await until(lambda holder=holder: records(router)[holder].load.queued_prompt_tokens
                    == 0, "a load report written after turn 1")
        second = [*first, *answer, *tokenizer.encode(" And what comes next?")]
        choice = await choose(router, second)
        assert choice.prefill is not None and choice.prefill.worker_id == holder
        assert choice.reason == "prefix"
    # Each conversation found its own holder, whichever that was; the second prompt
    # shares no block with the first, so either worker could have taken it.
    assert holders <= {"events-prefill-a", "events-prefill-b"}


async def test_a_second_turn_ships_only_the_blocks_its_decode_worker_lacks(
        router: RouterBackend, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The decode worker caches turn 1's prompt (it loaded it); the router knows it from
    the worker's events and tells the prefill worker to leave those blocks out (token
    parity with colocated for such transfers: tests/integration/test_kv_reuse.py)."""
    first = prompt_of_length(tokenizer, 6 * BLOCK, salt="a conversation about bridges")
    answer = await run(router, first, max_tokens=8)
    await until(lambda: hits(router, first)["events-decode"] >= 6 * BLOCK,
                "turn 1's blocks in the decode worker's index")
    second = [*first, *answer, *tokenizer.encode(" Tell me more about the oldest one.")]
    req = GenerationRequest("second-turn", second, Sampling(temperature=0.0), 4)
    final = None
    async for delta in router.generate(req):
        final = delta if delta.finished else final
    assert final is not None
    t = final.timings
    assert t.kv_reused_tokens >= 6 * BLOCK, t
    # Shipped: at most the blocks after turn 1's six.
    blocks = -(-len(second) // BLOCK)
    assert 0 < t.kv_transfer_bytes * blocks <= t.kv_prompt_bytes * (blocks - 6), t


async def test_evicted_blocks_leave_the_index(router: RouterBackend, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The engines' caches hold about 180 blocks (1 GiB): new prompts evict the oldest
    blocks, and the decode worker, which caches every prompt, drops the first one."""
    first = prompt_of_length(tokenizer, 14 * BLOCK, salt="evicted first")
    # Two tokens: an answer that ends at token 1 never reaches the decode worker.
    await run(router, first, max_tokens=2)
    await until(lambda: hits(router, first)["events-decode"] == 14 * BLOCK,
                "the first prompt cached on the decode worker")
    removed = EVENTS.labels("removed")._value.get()
    for i in range(30):
        await run(router, prompt_of_length(tokenizer, 14 * BLOCK, salt=f"filler {i}"),
                  max_tokens=2)
        if hits(router, first)["events-decode"] < 14 * BLOCK:
            break
    assert hits(router, first)["events-decode"] < 14 * BLOCK, "nothing was evicted"
    assert EVENTS.labels("removed")._value.get() > removed


async def test_a_restarted_worker_starts_with_no_blocks(
        router: RouterBackend, stack: Stack, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = prompt_of_length(tokenizer, 3 * BLOCK, salt="held before a restart")
    await run(router, ids)
    await until(lambda: hits(router, ids)["events-decode"] == 3 * BLOCK,
                "the prompt cached on the decode worker")
    epoch = records(router)["events-decode"].epoch
    stack.workers["events-decode"].stop()
    restarted = stack.worker("events-decode", "decode", "1")
    await restarted.wait_ready(timeout=900)
    await until(lambda: records(router)["events-decode"].epoch != epoch
                if "events-decode" in records(router) else False, "the new epoch in the view")
    # The new engine's cache is empty, and so is the index's view of it.
    assert router.kv_index.tracking("events-decode")
    assert hits(router, ids)["events-decode"] == 0
    # Batches published before the router's stream opens are not seen (as after any
    # subscription): the request waits for it.
    await until(lambda: "events-decode" in router.kv_feeds.subscribed, "subscribed again")
    await run(router, ids)
    await until(lambda: hits(router, ids)["events-decode"] == 3 * BLOCK,
                "the restarted engine's events reach the index")
