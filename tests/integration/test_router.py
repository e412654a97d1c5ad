"""The router in front of real pools: two prefill workers and one decode worker (real
vLLM engines, standalone processes as Kubernetes pods would run them), a real
redis-server, two router replicas."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.api.client import PdserveClient, build_request, collect
from services.messages import GenerationRequest, Sampling
from services.registry.records import WorkerRecord
from services.registry.redis_server import RedisServer
from services.registry.registry import Registry, redis_client
from services.registry.signing import RecordSigner
from services.router.config import RouterConfig
from services.router.router import RouterBackend
from services.router.view import FixedView
from tests.helpers.prompts import prompt_of_length
from tests.helpers.servers import ServerProcess, scrape
from tests.helpers.streams import reference, streams_through
from tests.unit.test_pair_run import (
    ANSWER,
    FakeDecodeWorker,
    FakePrefillWorker,
    FakeTokenizer,
    record,
    serve_fake,
)
from tests.unit.test_pair_run import collect as collect_deltas

pytestmark = [pytest.mark.engine, pytest.mark.slow]


# The pool's cluster secret: workers sign their records with it, routers check them.
SECRET = "router-tests-cluster-secret"


def registry_of(redis: RedisServer) -> Registry:
    return Registry.from_url(redis.url, signer=RecordSigner(SECRET.encode()))


class Pool:
    def __init__(self, redis: RedisServer, workdir: Path) -> None:
        self.redis = redis
        self.workdir = workdir
        self.workers: dict[str, ServerProcess] = {}
        self.routers: list[ServerProcess] = []

    def worker(self, name: str, role: str, cores: str) -> ServerProcess:
        proc = ServerProcess(
            ["--redis-url", self.redis.url, "--worker-id", name, "--cpu-cores", cores,
             "--kv-cache-gib", "1", "--worker-ttl-s", "3"],
            self.workdir / f"{name}.log", command=role,
            env={"PDSERVE_CLUSTER_SECRET": SECRET})
        proc.start()
        self.workers[name] = proc
        return proc

    def router(self, *extra: str) -> ServerProcess:
        proc = ServerProcess(["--redis-url", self.redis.url, *extra],
                             self.workdir / f"router-{len(self.routers)}.log", command="router",
                             env={"PDSERVE_CLUSTER_SECRET": SECRET})
        proc.start()
        self.routers.append(proc)
        return proc

    def stop(self) -> None:
        for proc in [*self.routers, *self.workers.values()]:
            proc.stop()


@pytest.fixture(scope="module")
async def pool(redis: RedisServer, session_dir: Path, model_path: Path) -> AsyncIterator[Pool]:
    pool = Pool(redis, session_dir)
    try:
        pool.worker("prefill-a", "prefill", "0")
        pool.worker("prefill-b", "prefill", "0")
        pool.worker("decode-a", "decode", "1")
        pool.router()
        pool.router("--max-inflight", "2")
        await asyncio.gather(*(p.wait_ready(timeout=900) for p in
                               [*pool.workers.values(), *pool.routers]))
        yield pool
    finally:
        pool.stop()


def worker_counts(router: ServerProcess, role: str) -> Counter[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics").read()
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == "pdserve_router_worker_requests_total" and s.labels["role"] == role:
                counts[s.labels["worker"]] = int(s.value)
    return counts


class PrefixIndexOnRedis(FixedView):
    """The fixed workers, with the prefix index of a real Redis registry."""

    def __init__(self, records: list[WorkerRecord], registry: Registry) -> None:
        super().__init__(records)
        self.registry = registry

    async def prefix_hits(self, block_hashes: Sequence[str], block_size: int) -> dict[str, int]:
        return await self.registry.prefix_hits(block_hashes, block_size)

    async def record_prefix(self, worker_id: str, block_hashes: Sequence[str]) -> None:
        await self.registry.record_prefix(worker_id, block_hashes)


async def test_a_stalled_prefix_index_write_does_not_hold_the_first_token() -> None:
    # Redis stops taking writes (CLIENT PAUSE WRITE; reads go on): the prefix index
    # write after token 1 stalls with it, in the background. The workers are fakes
    # (scripted gRPC servicers): only the router and Redis are real.
    redis = RedisServer().start()  # its own: the pause must not stall the pool's heartbeats
    workers = {"p": FakePrefillWorker(), "d": FakeDecodeWorker()}
    servers = {name: await serve_fake(w) for name, w in workers.items()}
    # A client timeout far past the pause would hold a request that waited on the write.
    registry = Registry(redis_client(redis.url, timeout_s=30.0))
    view = PrefixIndexOnRedis([record("p", "prefill", servers["p"][1]),
                               record("d", "decode", servers["d"][1])], registry)
    backend = RouterBackend(RouterConfig(policy="load", local_prefill_max_tokens=0,
                                         prefix_block_size=2), view,
                            FakeTokenizer(), "")  # type: ignore[arg-type]
    try:
        await backend.start(0)
        await registry.redis.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
        for request_id in ("first", "second"):
            started = time.monotonic()
            stream = backend.generate(GenerationRequest(request_id, [1, 2, 3, 4], Sampling(
                temperature=0.0), 6))
            first = await asyncio.wait_for(anext(stream), 10)
            assert time.monotonic() - started < 2.0
            tokens, last = await collect_deltas(stream)
            assert [*first.token_ids, *tokens] == ANSWER[:6] and last.finish_reason
        assert len(workers["p"].requests) == 2  # prefilled there (the lookup still read)
        assert backend.prefix_hints.pending == 2  # both writes still waiting on Redis
        await backend.close()  # cancels them
        assert backend.prefix_hints.pending == 0
    finally:
        await registry.redis.execute_command("CLIENT", "UNPAUSE")
        await backend.close()
        await registry.close()
        for server, _ in servers.values():
            await server.stop(0)
        redis.cleanup()


async def test_router_output_identical_to_colocated(pool: Pool, colocated: ServerProcess,
                                                    tokenizer) -> None:  # type: ignore[no-untyped-def]
    for n in (7, 300):
        ids = prompt_of_length(tokenizer, n, salt="router identity")
        async with PdserveClient(colocated.target) as c1, \
                PdserveClient(pool.routers[0].target) as c2:
            a = await c1.generate(token_ids=ids, temperature=0.0, max_tokens=10, ignore_eos=True)
            b = await c2.generate(token_ids=ids, temperature=0.0, max_tokens=10, ignore_eos=True)
        assert a.token_ids == b.token_ids
        assert b.timings["kv_transfer_bytes"] > 0


async def test_burst_spreads_over_both_prefill_workers(pool: Pool, tokenizer) -> None:  # type: ignore[no-untyped-def]
    router = pool.routers[0]
    before = worker_counts(router, "prefill")
    async with PdserveClient(router.target) as client:
        results = await asyncio.gather(*(
            client.generate(token_ids=prompt_of_length(tokenizer, 400, salt=f"burst {i}"),
                            temperature=0.0, max_tokens=4, ignore_eos=True)
            for i in range(6)))
    assert all(r.completion_tokens == 4 for r in results)
    spread = worker_counts(router, "prefill") - before
    assert set(spread) == {"prefill-a", "prefill-b"}, spread


async def test_shared_prefix_goes_to_the_worker_that_holds_it(pool: Pool, tokenizer) -> None:  # type: ignore[no-untyped-def]
    router = pool.routers[0]
    prefix = prompt_of_length(tokenizer, 640, salt="shared system prompt")
    before = worker_counts(router, "prefill")
    async with PdserveClient(router.target) as client:
        for i in range(4):
            suffix = prompt_of_length(tokenizer, 20, salt=f"question {i}")
            await client.generate(token_ids=prefix + suffix, temperature=0.0, max_tokens=2)
    used = worker_counts(router, "prefill") - before
    assert len(used) == 1 and sum(used.values()) == 4, used
    choices = scrape(router.metrics_port, reason="prefix")
    assert choices["pdserve_router_pair_choices_total"] >= 3


async def test_overload_gets_resource_exhausted_and_every_request_ends_once(
    pool: Pool, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    small = pool.routers[1]  # --max-inflight 2, same Redis and workers as router 0

    async def one(i: int) -> str:
        async with PdserveClient(small.target) as client:
            call = client.call(build_request(
                token_ids=prompt_of_length(tokenizer, 200, salt=f"overload {i}"),
                temperature=0.0, max_tokens=16, ignore_eos=True), timeout=300)
            try:
                await collect(call)
                return "OK"
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    trailing = dict(e.trailing_metadata() or ())
                    assert int(trailing["retry-after-ms"]) > 0
                return e.code().name

    outcomes = Counter(await asyncio.gather(*(one(i) for i in range(8))))
    assert sum(outcomes.values()) == 8
    assert outcomes["OK"] >= 2 and outcomes["RESOURCE_EXHAUSTED"] >= 1, outcomes
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes


async def test_killed_prefill_worker_drops_out_and_requests_still_succeed(
    pool: Pool, redis: RedisServer, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    victim = pool.workers["prefill-b"]
    assert victim.proc is not None
    os.killpg(victim.proc.pid, signal.SIGKILL)
    registry = registry_of(redis)
    try:
        deadline = time.monotonic() + 10
        while any(w.worker_id == "prefill-b" for w in await registry.workers()):
            assert time.monotonic() < deadline, "the dead worker is still registered"
            await asyncio.sleep(0.25)
    finally:
        await registry.close()
    async with PdserveClient(pool.routers[0].target) as client:
        for i in range(4):
            r = await client.generate(token_ids=prompt_of_length(tokenizer, 150, salt=f"k{i}"),
                                      temperature=0.0, max_tokens=3, ignore_eos=True)
            assert r.completion_tokens == 3


async def test_registry_rebuilds_after_a_redis_restart(pool: Pool, redis: RedisServer,
                                                       tokenizer) -> None:  # type: ignore[no-untyped-def]
    redis.stop()
    # the routers keep their last view: serving goes on while Redis is away
    async with PdserveClient(pool.routers[0].target) as client:
        r = await client.generate(token_ids=[1, 2, 3, 4], temperature=0.0, max_tokens=2)
        assert r.completion_tokens == 2
    redis.start()  # same port, empty: the heartbeats fill it again
    registry = registry_of(redis)
    try:
        deadline = time.monotonic() + 15
        while {w.worker_id for w in await registry.workers()} != {"prefill-a", "decode-a"}:
            assert time.monotonic() < deadline, "workers did not re-register"
            await asyncio.sleep(0.25)
    finally:
        await registry.close()
    await asyncio.sleep(2 * 0.5)  # the routers re-read the registry every 0.5 s
    async with PdserveClient(pool.routers[1].target) as client:
        r = await client.generate(token_ids=prompt_of_length(tokenizer, 50, salt="after"),
                                  temperature=0.0, max_tokens=2)
        assert r.completion_tokens == 2



# -- failures: client errors, hangs and crashes (in this order: the last kills decode-a) --
def migrations(router: ServerProcess) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics").read()
    return sum(s.value for f in text_string_to_metric_families(text.decode())
               for s in f.samples if s.name == "pdserve_migrations_total")


async def test_client_errors_never_count_against_a_worker(pool: Pool, tokenizer) -> None:  # type: ignore[no-untyped-def]
    router = pool.routers[0]
    before = migrations(router)
    async with PdserveClient(router.target) as client:
        for bad in ({"temperature": float("inf")}, {"temperature": 1e30},
                    {"repetition_penalty": float("nan")}, {"seed": 2**63}):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(text="hello", max_tokens=4, **bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        async with grpc.aio.insecure_channel(router.target) as channel:
            garbage = channel.unary_stream("/pdserve.v1.GenerationService/Generate",
                                           request_serializer=lambda b: b)
            for junk in (b"\xff\xff\xff", b"\x0a\x05abc"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in garbage(junk):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the pair is still the first choice: nothing was marked suspect
        r = await client.generate(token_ids=prompt_of_length(tokenizer, 200, salt="after bad"),
                                  temperature=0.0, max_tokens=3, ignore_eos=True)
    assert r.completion_tokens == 3 and r.timings["kv_transfer_bytes"] > 0
    assert migrations(router) == before


async def test_a_hung_decode_worker_is_detected_and_its_streams_move(
    pool: Pool, colocated: ServerProcess, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    victim = pool.workers["decode-a"]
    assert victim.proc is not None
    prompts = [prompt_of_length(tokenizer, n, salt=f"hang {n}") for n in (60, 300)]
    expected = await reference(colocated, prompts, 48)
    try:
        results = await streams_through(pool.routers[0], prompts, 48,
                                        lambda: os.killpg(victim.proc.pid, signal.SIGSTOP))
    finally:
        os.killpg(victim.proc.pid, signal.SIGCONT)
    for (tokens, moved), want in zip(results, expected, strict=True):
        assert tokens == want  # no token lost, none repeated, the same greedy answer
        assert moved >= 1


async def test_a_killed_decode_worker_loses_no_stream(
    pool: Pool, colocated: ServerProcess, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    # decode-a is back in rotation after its hang: its pause (2 s, 4 s after two failed
    # streams) is over and it answered the router's next health probe.
    await asyncio.sleep(6)
    victim = pool.workers["decode-a"]
    assert victim.proc is not None
    prompts = [prompt_of_length(tokenizer, n, salt=f"crash {n}") for n in (80, 500)]
    # Long enough that the short prompt's answer is still streaming when the long one's
    # reaches 8 tokens (its prefill shares a core with another prefill worker).
    expected = await reference(colocated, prompts, 160)
    router = pool.routers[0]
    before = migrations(router)
    results = await streams_through(router, prompts, 160,
                                    lambda: os.killpg(victim.proc.pid, signal.SIGKILL))
    for (tokens, moved), want in zip(results, expected, strict=True):
        assert tokens == want
        assert moved >= 1
    assert migrations(router) >= before + 2
    # with the only decode worker dead, the prefill worker serves whole requests
    started = time.monotonic()
    async with PdserveClient(router.target) as client:
        r = await client.generate(token_ids=prompt_of_length(tokenizer, 40, salt="degraded"),
                                  temperature=0.0, max_tokens=4, ignore_eos=True)
    assert r.completion_tokens == 4 and time.monotonic() - started < 5
