"""The pair run and the router's admission, retries and migrations, in process: the
router code is real, the workers are FAKES (scripted gRPC servicers on loopback), so
every failure is exactly the one the test wants. No engine, no Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services.engine.engine import ModelFacts
from services.errors import InvalidRequest, Overloaded, WorkerFailure
from services.messages import Delta, GenerationRequest, Sampling
from services.registry.records import WorkerRecord
from services.router.config import RouterConfig
from services.router.orchestrator import Peer, run_pair
from services.router.router import RouterBackend
from services.router.view import FixedView
from services.server.channels import dial

ANSWER = [11, 12, 13, 14, 15, 16, 17, 18]  # the fake model's greedy answer to any prompt


def next_of(prompt: list[int]) -> int:
    """The fake model's next token: the next of ANSWER after those the prompt holds."""
    return ANSWER[len([t for t in prompt if t in ANSWER])]


class FakePrefillWorker(wpb_grpc.PrefillServiceServicer):
    """Answers the next token of ANSWER at once; ships nothing."""

    def __init__(self) -> None:
        self.requests: list[wpb.PrefillRequest] = []

    async def Prefill(self, req: wpb.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> wpb.PrefillResponse:
        self.requests.append(req)
        return wpb.PrefillResponse(
            first_token_id=next_of(list(req.prompt_token_ids)), first_token_text="a",
            queue_s=0.25, prefill_s=0.5,
            handle=wpb.TransferHandle(transfer_id=req.transfer_id, num_tokens=len(
                req.prompt_token_ids), decode_epoch=req.target.epoch))


@dataclass
class FakeDecodeWorker(wpb_grpc.DecodeServiceServicer):
    """Streams the rest of ANSWER after what the request already holds; scripted to
    fail (`fail_after` tokens, then `fail_code`) or to hang (stop answering, health
    included) after `hang_after` tokens."""

    fail_after: int | None = None
    fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    hang_after: int | None = None
    requests: list[wpb.DecodeRequest] = field(default_factory=list)
    hung: asyncio.Event = field(default_factory=asyncio.Event)
    released: list[str] = field(default_factory=list)  # transfer ids, in order
    release_seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def Release(self, req: wpb.ReleaseRequest, context: grpc.aio.ServicerContext
                      ) -> wpb.ReleaseResponse:
        self.released.append(req.transfer_id)
        self.release_seen.set()
        return wpb.ReleaseResponse()

    async def Decode(self, req: wpb.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(req)
        held = [*req.prompt_token_ids, *([req.first_token_id] if req.HasField("handle")
                                         else [])]
        done = len([t for t in held if t in ANSWER])
        for i, token in enumerate(ANSWER[done:done + req.sampling.max_tokens]):
            if self.fail_after is not None and i >= self.fail_after:
                await context.abort(self.fail_code, "scripted failure")
            if self.hang_after is not None and i >= self.hang_after:
                self.hung.set()
                await asyncio.sleep(3600)
            yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=[token], text="x"))
        yield pb.GenerateResponse(final=pb.Final(
            finish_reason=pb.FINISH_REASON_LENGTH,
            timings=pb.Timings(decode_s=1.0, decode_queue_s=0.125)))


class HangingHealth(health.aio.HealthServicer):
    """Health of a hung process: no answer once its worker hung."""

    def __init__(self, worker: FakeDecodeWorker) -> None:
        super().__init__()
        self.worker = worker

    async def Check(self, request, context):  # type: ignore[no-untyped-def]
        if self.worker.hung.is_set():
            await asyncio.sleep(3600)
        return await super().Check(request, context)


async def serve_fake(servicer: object) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    if isinstance(servicer, FakePrefillWorker):
        wpb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
        # like a real prefill worker, it also serves whole requests
        wpb_grpc.add_DecodeServiceServicer_to_server(FakeDecodeWorker(), server)
    else:
        assert isinstance(servicer, FakeDecodeWorker)
        wpb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(HangingHealth(servicer), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def record(worker_id: str, role: str, address: str) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, address=address, host="h", epoch=1,
                        fingerprint="f", kv_address="127.0.0.1:1" if role == "decode" else "",
                        kv_transport="grpc" if role == "decode" else "", capacity=8,
                        model="fake", max_model_len=64, vocab_size=100, dtype="float32")


class FakeTokenizer:
    eos_token_id = 2
    bos_token_id = None
    chat_template = None


def request(max_tokens: int = 6, min_tokens: int = 0) -> GenerationRequest:
    return GenerationRequest("r-1", [1, 2, 3], Sampling(temperature=0.0, min_tokens=min_tokens),
                             max_tokens)


async def collect(stream: AsyncIterator[Delta]) -> tuple[list[int], Delta]:
    tokens: list[int] = []
    last = Delta([], "")
    async for d in stream:
        tokens += d.token_ids
        last = d
    return tokens, last


@pytest.fixture
async def fakes() -> AsyncIterator[dict[str, tuple[object, str]]]:
    workers: dict[str, object] = {"p": FakePrefillWorker(), "d1": FakeDecodeWorker(),
                                  "d2": FakeDecodeWorker()}
    servers = {}
    for name, w in workers.items():
        servers[name] = await serve_fake(w)
    yield {name: (workers[name], servers[name][1]) for name in workers}
    for server, _ in servers.values():
        await server.stop(0)


async def test_pair_run_splits_the_budget_and_merges_the_timings(fakes) -> None:  # type: ignore[no-untyped-def]
    (prefill, p_addr), (decode, d_addr) = fakes["p"], fakes["d1"]
    async with dial(p_addr, None) as pc, dial(d_addr, None) as dc:
        tokens, last = await collect(run_pair(request(6, 4), Peer("p", pc), Peer("d1", dc),
                                              wpb.KVTarget(worker_id="d1", epoch=1)))
    assert tokens == ANSWER[:6]
    assert prefill.requests[0].sampling.max_tokens == 1
    assert prefill.requests[0].sampling.min_tokens == 1
    d = decode.requests[0]
    assert (d.sampling.max_tokens, d.sampling.min_tokens) == (5, 3)
    assert d.first_token_id == ANSWER[0] and d.handle.transfer_id
    t = last.timings
    assert (t.queue_s, t.prefill_s, t.decode_s, t.decode_queue_s) == (0.25, 0.5, 1.0, 0.125)


async def test_the_decode_workers_cached_prefix_goes_to_the_prefill_worker(fakes) -> None:  # type: ignore[no-untyped-def]
    # Its blocks are not shipped; without a hint every block is (0).
    (prefill, p_addr), (_, d_addr) = fakes["p"], fakes["d1"]
    async with dial(p_addr, None) as pc, dial(d_addr, None) as dc:
        for reuse in (256, 0):
            await collect(run_pair(request(6), Peer("p", pc), Peer("d1", dc),
                                   wpb.KVTarget(worker_id="d1", epoch=1), reuse_tokens=reuse))
    assert [r.reuse_tokens for r in prefill.requests] == [256, 0]


async def test_a_one_token_answer_never_reaches_decode(fakes) -> None:  # type: ignore[no-untyped-def]
    (prefill, p_addr), (decode, d_addr) = fakes["p"], fakes["d1"]
    async with dial(p_addr, None) as pc, dial(d_addr, None) as dc:
        tokens, last = await collect(run_pair(request(1), Peer("p", pc), Peer("d1", dc),
                                              wpb.KVTarget(worker_id="d1", epoch=1)))
        await asyncio.wait_for(decode.release_seen.wait(), 5)
    assert tokens == ANSWER[:1] and last.finish_reason == "length"
    assert decode.requests == []
    # ... but its KV was shipped there: released at once rather than left to its lease
    assert decode.released == [prefill.requests[0].transfer_id]


async def test_a_loaded_transfer_is_not_released(fakes) -> None:  # type: ignore[no-untyped-def]
    (_, p_addr), (decode, d_addr) = fakes["p"], fakes["d1"]
    async with dial(p_addr, None) as pc, dial(d_addr, None) as dc:
        tokens, _ = await collect(run_pair(request(6), Peer("p", pc), Peer("d1", dc),
                                           wpb.KVTarget(worker_id="d1", epoch=1)))
        await asyncio.sleep(0.2)
    assert tokens == ANSWER[:6] and decode.released == []


async def test_a_cancelled_request_releases_its_transfer(fakes) -> None:  # type: ignore[no-untyped-def]
    # The client goes away after token 1: the decode worker is told to drop the KV
    # shipped for the request (the prefill's transfer id) instead of holding it.
    (prefill, p_addr), (decode, d_addr) = fakes["p"], fakes["d1"]
    async with dial(p_addr, None) as pc, dial(d_addr, None) as dc:
        stream = run_pair(request(6), Peer("p", pc), Peer("d1", dc),
                          wpb.KVTarget(worker_id="d1", epoch=1))
        first = await anext(stream)
        await stream.aclose()
        await asyncio.wait_for(decode.release_seen.wait(), 5)
    assert first.token_ids == ANSWER[:1]
    assert decode.released == [prefill.requests[0].transfer_id]


def router(fakes, decodes: tuple[str, ...] = ("d1", "d2"), **config: object) -> RouterBackend:  # type: ignore[no-untyped-def]
    view = FixedView([record("p", "prefill", fakes["p"][1]),
                      *(record(d, "decode", fakes[d][1]) for d in decodes)])
    cfg = RouterConfig(stream_silence_s=0.2, probe_timeout_s=0.2, **config)  # type: ignore[arg-type]
    backend = RouterBackend(cfg, view, FakeTokenizer(), "")  # type: ignore[arg-type]
    backend._facts = ModelFacts("fake", Path("."), 64, 100, (2,), None, False, "Fake", "f32")
    return backend


async def test_a_decode_failure_mid_stream_moves_the_request(fakes) -> None:  # type: ignore[no-untyped-def]
    failing, other = fakes["d1"][0], fakes["d2"][0]
    failing.fail_after = 2  # d1 is the first choice (equal load: the first listed)
    backend = router(fakes)
    await backend.start(0)
    try:
        tokens, last = await collect(backend.generate(request(8)))
    finally:
        await backend.close()
    # The client got the whole answer once, in order, across the move.
    assert tokens == ANSWER[:8]
    assert last.migrations == 1 and len(failing.requests) == 1
    moved = other.requests[0]
    # The continuation holds everything already streamed (prefilled again, its token 1
    # from the prefill worker) and only the rest of the budget.
    assert list(moved.prompt_token_ids) == [1, 2, 3, *ANSWER[:3]]
    assert 3 + 1 + moved.sampling.max_tokens == 8


async def test_a_hung_decode_worker_is_probed_and_left(fakes) -> None:  # type: ignore[no-untyped-def]
    fakes["d1"][0].hang_after = 1
    backend = router(fakes, decodes=("d1",))
    await backend.start(0)
    try:
        tokens, last = await collect(backend.generate(request(8)))
    finally:
        await backend.close()
    # d1 hung after one of its tokens; the prefill worker (a full engine) finished it.
    assert tokens == ANSWER[:8] and last.migrations == 1


async def test_a_hung_worker_stays_out_until_it_answers_a_probe(  # type: ignore[no-untyped-def]
        fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.router import router as router_module

    monkeypatch.setattr(router_module, "SUSPECT_S", 0.2)  # a short first pause
    hung = fakes["d1"][0]
    hung.hang_after = 1
    backend = router(fakes, refresh_s=0.1)
    await backend.start(0)
    try:
        _, last = await collect(backend.generate(request(8)))
        assert last.migrations == 1  # d1 (the first choice) hung; d2 finished it
        # Long past its pause, d1 is still out: it answers no health probe. Requests
        # are not sent to it to find out.
        await asyncio.sleep(1.0)
        assert [w.worker_id for w in backend._live("decode")] == ["d2"]
        for _ in range(3):
            _, last = await collect(backend.generate(request(8)))
            assert last.migrations == 0
        assert len(hung.requests) == 1
        # It answers again (a SIGCONT): back in rotation at the next probe.
        hung.hang_after = None
        hung.hung.clear()
        deadline = asyncio.get_running_loop().time() + 10
        while "d1" not in {w.worker_id for w in backend._live("decode")}:
            assert asyncio.get_running_loop().time() < deadline, "d1 never came back"
            await asyncio.sleep(0.05)
    finally:
        await backend.close()


async def test_client_errors_pass_through_and_never_move(fakes) -> None:  # type: ignore[no-untyped-def]
    for name in ("d1", "d2"):
        fakes[name][0].fail_after, fakes[name][0].fail_code = 0, grpc.StatusCode.INVALID_ARGUMENT
    backend = router(fakes)
    await backend.start(0)
    try:
        with pytest.raises(InvalidRequest):
            await collect(backend.generate(request(4)))
        # nobody was taken out of rotation by the client's error
        assert {w.worker_id for w in backend._live("decode")} == {"d1", "d2"}
    finally:
        await backend.close()


async def test_the_migration_limit_ends_the_request(fakes) -> None:  # type: ignore[no-untyped-def]
    for name in ("d1", "d2"):
        fakes[name][0].fail_after = 1
    backend = router(fakes, migration_limit=1)
    await backend.start(0)
    try:
        with pytest.raises(WorkerFailure):
            await collect(backend.generate(request(8)))
    finally:
        await backend.close()


async def test_admission_bounds(fakes) -> None:  # type: ignore[no-untyped-def]
    backend = router(fakes, max_inflight=1, client_max_inflight=1)
    await backend.start(0)
    try:
        first = backend.generate(request(8))
        await anext(first)  # in flight
        with pytest.raises(Overloaded) as e:
            await collect(backend.generate(request(2)))
        assert e.value.retry_after_ms == backend.config.retry_after_ms
        await first.aclose()
        # the per-client lease: one request per client
        limited = router(fakes, client_max_inflight=1)
        await limited.start(0)
        a = limited.generate(GenerationRequest("a", [1], Sampling(), 4, client_id="c"))
        await anext(a)
        with pytest.raises(Overloaded, match="client 'c'"):
            await collect(limited.generate(GenerationRequest("b", [1], Sampling(), 4,
                                                             client_id="c")))
        await a.aclose()
        tokens, _ = await collect(limited.generate(GenerationRequest("c", [1], Sampling(), 4,
                                                                     client_id="c")))
        assert len(tokens) == 4
        await limited.close()
    finally:
        await backend.close()
