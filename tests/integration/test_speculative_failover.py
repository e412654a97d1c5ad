"""A decode pool that runs speculative decoding (vLLM's ngram proposer) when one of its
workers is SIGKILLed mid-answer: the router moves the streams it held to the other decode
worker, which speculates too, and every client's tokens, the ones before the kill and the
ones after, are the colocated engine's greedy tokens (an engine that speculates nothing).

One prefill worker and two decode workers (standalone processes sharing a real
redis-server, as test_router.py's pool) behind one router: the decode workers alone carry
the proposer, as `--speculative-config` on the decode command gives it."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.registry.redis_server import RedisServer
from tests.helpers.prompts import prompt_of_length
from tests.helpers.servers import ServerProcess, scrape
from tests.helpers.streams import reference, streams_through
from tests.integration.test_router import SECRET, Pool, worker_counts
from tests.integration.test_speculative import DRAFTS, NGRAM, counter

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# Long enough that the long prompt's answer is still streaming when the short prompt's,
# started after it, reaches the kill: the decode workers speculate, so they decode fast.
MAX_TOKENS = 240


class SpecPool(Pool):
    """test_router.py's pool, whose workers take extra arguments (the proposer)."""

    def worker(self, name: str, role: str, cores: str, *extra: str) -> ServerProcess:
        proc = ServerProcess(
            ["--redis-url", self.redis.url, "--worker-id", name, "--cpu-cores", cores,
             "--kv-cache-gib", "1", "--worker-ttl-s", "3", *extra],
            self.workdir / f"spec-{name}.log", command=role,
            env={"PDSERVE_CLUSTER_SECRET": SECRET})
        proc.start()
        self.workers[name] = proc
        return proc


@pytest.fixture(scope="module")
async def spec_pool(redis: RedisServer, session_dir: Path, model_path: Path
                    ) -> AsyncIterator[SpecPool]:
    pool = SpecPool(redis, session_dir)
    try:
        pool.worker("prefill-a", "prefill", "0")
        pool.worker("decode-a", "decode", "1", "--speculative-config", NGRAM)
        pool.worker("decode-b", "decode", "0", "--speculative-config", NGRAM)
        await asyncio.gather(*(p.wait_ready(timeout=900) for p in pool.workers.values()))
        # Started once every worker is registered, so that it knows both decode workers.
        await pool.router().wait_ready(timeout=300)
        yield pool
    finally:
        pool.stop()


async def test_streams_of_a_killed_speculating_decode_worker_move_to_the_other_one(
    spec_pool: SpecPool, colocated: ServerProcess, tokenizer: Any) -> None:
    router = spec_pool.routers[0]
    prompts = [prompt_of_length(tokenizer, n, salt=f"spec crash {n}") for n in (60, 300)]
    expected = await reference(colocated, prompts, MAX_TOKENS)
    before = worker_counts(router, "decode")
    at_kill: list[Counter[str]] = []  # the router's decode counts when the kill came
    victims: list[str] = []

    def kill_the_busier_decode_worker() -> None:
        # The router may have put both streams on one decode worker or one on each: the
        # one that got more of them dies, so at least one stream has to move.
        at_kill.append(worker_counts(router, "decode"))
        got = at_kill[0] - before
        victim = max(("decode-a", "decode-b"), key=lambda w: got[w])
        victims.append(victim)
        proc = spec_pool.workers[victim].proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)

    results = await streams_through(router, prompts, MAX_TOKENS, kill_the_busier_decode_worker)
    for (tokens, _), want in zip(results, expected, strict=True):
        assert tokens == want  # no token lost, none repeated, the plain greedy answer
    moved = sum(1 for _, m in results if m >= 1)
    assert moved >= 1, "no stream moved: the killed decode worker held none"
    survivor = "decode-b" if victims == ["decode-a"] else "decode-a"
    # Each moved stream ended on the surviving decode worker, not on the prefill worker
    # serving whole requests on its own (which runs no proposer).
    taken = worker_counts(router, "decode")[survivor] - at_kill[0][survivor]
    assert taken >= moved, (taken, moved, spec_pool.workers[survivor].log_tail(40))
    drafts = counter(scrape(spec_pool.workers[survivor].metrics_port), DRAFTS)
    assert drafts > 0, "the surviving decode worker proposed no drafts"
