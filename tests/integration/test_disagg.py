"""Disaggregated prefill -> decode over the gRPC KV transport, on real vLLM engines:
token identity with the colocated engine, proof that the decode engine used the shipped
KV, integrity faults, KV freed on both sides, and refusals."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services.api.client import PdserveClient, build_request, collect
from services.kv.params import FAULT_CORRUPT_CHUNK, FAULT_NOISE_KV
from services.launcher.local_pair import pair_view
from services.messages import GenerationRequest, Sampling
from services.router.config import RouterConfig
from services.router.router import RouterBackend
from tests.helpers.prompts import prompt_of_length
from tests.helpers.servers import DisaggStack, ServerProcess, scrape

pytestmark = pytest.mark.engine

LENGTHS = (5, 127, 128, 129, 1000, 1900)
MAX_TOKENS = 12


async def greedy(target: str, ids: list[int], max_tokens: int = MAX_TOKENS,
                 shipped: bool = False) -> list[int]:
    """Greedy token ids; with `shipped`, also check the KV really came by transfer."""
    async with PdserveClient(target) as client:
        result = await client.generate(token_ids=ids, temperature=0.0, max_tokens=max_tokens,
                                       ignore_eos=True)
    assert result.completion_tokens == max_tokens
    if shipped:
        assert result.timings.get("kv_transfer_bytes", 0) > 0, "the KV was not shipped"
    return result.token_ids


async def check_identical(stack: DisaggStack, colocated: ServerProcess, tokenizer) -> None:  # type: ignore[no-untyped-def]
    for n in LENGTHS:
        # a distinct prompt per length: no local prefix-cache hit on the decode side
        ids = prompt_of_length(tokenizer, n, salt=f"identity {n} {stack.server.log_path.name}")
        assert len(ids) == n
        expected = await greedy(colocated.target, ids)
        got = await greedy(stack.server.target, ids, shipped=True)
        assert got == expected, f"{n}-token prompt"


async def test_greedy_output_identical_to_colocated(
    disagg_grpc: DisaggStack, colocated: ServerProcess, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    await check_identical(disagg_grpc, colocated, tokenizer)


async def test_decode_engine_used_the_shipped_kv(disagg_grpc: DisaggStack, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = prompt_of_length(tokenizer, 300, salt="counter check")
    before_shipped = scrape(disagg_grpc.decode_metrics, source="external_kv_transfer")
    before_p2p = scrape(disagg_grpc.decode_metrics, source="p2p")
    async with PdserveClient(disagg_grpc.server.target) as client:
        result = await client.generate(token_ids=ids, temperature=0.0, max_tokens=8,
                                       ignore_eos=True)
    t = result.timings
    assert t["kv_transfer_bytes"] > 0 and t["kv_transfer_s"] > 0
    # a fresh prompt: no prefix-cache hit anywhere, whatever the decode engine received
    assert result.cached_tokens == 0
    assert 0 <= t["kv_transfer_hidden_s"] <= t["kv_transfer_s"]
    deadline = time.monotonic() + 10
    while True:  # vLLM publishes its counters with each engine step's stats
        shipped = delta(before_shipped, scrape(disagg_grpc.decode_metrics,
                                               source="external_kv_transfer"),
                        "vllm:prompt_tokens_by_source_total")
        p2p = delta(before_p2p, scrape(disagg_grpc.decode_metrics, source="p2p"),
                    "vllm:prompt_tokens_cached_by_source_total")
        if (shipped >= 300 and p2p >= 300) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    # the whole prompt came through the connector, counted as a peer-to-peer cache hit
    assert (shipped, p2p) == (300, 300)
    # the same prompt again: the prefill engine's prefix cache holds its full blocks
    async with PdserveClient(disagg_grpc.server.target) as client:
        again = await client.generate(token_ids=ids, temperature=0.0, max_tokens=8,
                                      ignore_eos=True)
    assert 0 < again.cached_tokens < 300


async def test_short_prompts_prefill_on_the_decode_worker_when_asked(
    disagg_grpc: DisaggStack, colocated: ServerProcess, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    """Conditional disaggregation: below the threshold nothing is shipped, same tokens."""
    backend = await backend_for(disagg_grpc, tokenizer, local_prefill_max_tokens=100)
    try:
        for n, shipped in ((100, False), (101, True)):
            ids = prompt_of_length(tokenizer, n, salt=f"conditional {n}")
            req = GenerationRequest(uuid.uuid4().hex, ids, GREEDY, 6)
            deltas = [d async for d in backend.generate(req)]
            assert [t for d in deltas for t in d.token_ids] == await greedy(
                colocated.target, ids, max_tokens=6)
            timings = deltas[-1].timings
            assert (timings.kv_transfer_bytes > 0) == shipped, f"{n} tokens"
    finally:
        await backend.close()


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


GREEDY = Sampling(temperature=0.0, ignore_eos=True)


async def backend_for(stack: DisaggStack, tokenizer, fault: str = "",  # type: ignore[no-untyped-def]
                      local_prefill_max_tokens: int = 0) -> RouterBackend:
    """The router over this stack's pair, as `serve --mode disagg` runs it, with fault
    injection on every request."""
    view = await pair_view(stack.prefill_target, stack.decode_target)
    config = RouterConfig(local_prefill_max_tokens=local_prefill_max_tokens)
    backend = RouterBackend(config, view, tokenizer, "", fault)
    await backend.start(wait_for_workers_s=0)
    return backend


async def run_backend(backend: RouterBackend, ids: list[int], max_tokens: int) -> list[int]:
    req = GenerationRequest(uuid.uuid4().hex, ids, GREEDY, max_tokens)
    out: list[int] = []
    async for delta in backend.generate(req):
        out += delta.token_ids
    return out


async def test_noise_in_the_shipped_kv_changes_the_output(
    disagg_grpc: DisaggStack, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    ids = prompt_of_length(tokenizer, 400, salt="noise check")
    clean = await greedy(disagg_grpc.server.target, ids, 16)
    backend = await backend_for(disagg_grpc, tokenizer, FAULT_NOISE_KV)
    try:
        noisy = await run_backend(backend, prompt_of_length(tokenizer, 400, salt="noise check"),
                                  16)
    finally:
        await backend.close()
    assert noisy[0] == clean[0]  # token 1 comes from the prefill engine
    assert noisy != clean  # tokens 2.. read the KV the decode engine received


async def test_corrupt_chunk_is_detected_and_recomputed(
    disagg_grpc: DisaggStack, colocated: ServerProcess, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    ids = prompt_of_length(tokenizer, 257, salt="corruption check")
    expected = await greedy(colocated.target, ids)
    metric = "pdserve_kv_transfer_failures_total"
    before = scrape(disagg_grpc.decode_metrics).get(metric, 0.0)
    backend = await backend_for(disagg_grpc, tokenizer, FAULT_CORRUPT_CHUNK)
    try:
        got = await run_backend(backend, ids, MAX_TOKENS)
    finally:
        await backend.close()
    assert got == expected
    assert scrape(disagg_grpc.decode_metrics)[metric] == before + 1


async def _idle(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(port)
        if (m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
                and m["vllm:num_requests_waiting"] == 0):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV not freed on :{port}: usage {m['vllm:kv_cache_usage_perc']}")
        await asyncio.sleep(0.5)


async def _one(client: PdserveClient, ids: list[int], kind: int) -> str:
    request = build_request(token_ids=ids, temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        if kind == 0:  # cancelled after the first chunk
            call = client.call(request)
            async for _ in call:
                call.cancel()
                break
            return "cancelled"
        if kind == 1:  # deadline passes mid-request
            await collect(client.call(request, timeout=0.3))
            return "ok"
        result = await collect(client.call(request))
        assert result.completion_tokens == 24
        return "ok"
    except grpc.aio.AioRpcError as e:
        return e.code().name


async def test_kv_freed_on_both_sides_after_aborts_and_deadlines(
    disagg_grpc: DisaggStack, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    async with PdserveClient(disagg_grpc.server.target) as client:
        outcomes = []
        for batch in range(10):  # 50 requests, five at a time
            tasks = [_one(client, prompt_of_length(tokenizer, 60 + 37 * i, salt=f"b{batch}"),
                          (batch + i) % 3) for i in range(5)]
            outcomes += await asyncio.gather(*tasks)
    ended = time.monotonic()
    assert len(outcomes) == 50
    assert {"ok", "cancelled", "DEADLINE_EXCEEDED"} <= set(outcomes), outcomes
    await _idle(disagg_grpc.prefill_metrics)
    await _idle(disagg_grpc.decode_metrics)
    # The transfers of cancelled and timed-out requests were released, not left to
    # wait out their lease in the decode worker's staging.
    by = ended + LEASE_S / 3
    staged = await _staged(disagg_grpc.decode_metrics, 0.0, timeout=by - time.monotonic())
    assert staged["pdserve_kv_staged_transfers"] == 0.0 and time.monotonic() < by, staged
    assert (await greedy(disagg_grpc.server.target, [1, 2, 3, 4, 5], 4))  # still serving


@pytest.fixture
async def prefill_stub(disagg_grpc: DisaggStack) -> AsyncIterator[wpb_grpc.PrefillServiceStub]:
    async with grpc.aio.insecure_channel(disagg_grpc.prefill_target) as channel:
        yield wpb_grpc.PrefillServiceStub(channel)


async def test_fingerprint_mismatch_is_refused(
    disagg_grpc: DisaggStack, prefill_stub: wpb_grpc.PrefillServiceStub
) -> None:
    async with grpc.aio.insecure_channel(disagg_grpc.decode_target) as channel:
        info = await wpb_grpc.DecodeServiceStub(channel).GetWorkerInfo(
            wpb.GetWorkerInfoRequest())
    target = wpb.KVTarget(worker_id=info.worker_id, epoch=info.epoch,
                          kv_address=info.kv_address, kv_transport=info.kv_transport,
                          fingerprint_digest="0123456789abcdef")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await prefill_stub.Prefill(wpb.PrefillRequest(
            request_id="r-mismatch", prompt_token_ids=[1, 2, 3], transfer_id="t-mismatch",
            sampling=pb.SamplingParams(max_tokens=1), target=target))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "KV layout" in (err.value.details() or "")


async def _decode(stack: DisaggStack, req: wpb.DecodeRequest) -> list[int]:
    async with grpc.aio.insecure_channel(stack.decode_target) as channel:
        stub = wpb_grpc.DecodeServiceStub(channel)
        out: list[int] = []
        async for r in stub.Decode(req):
            if r.HasField("chunk"):
                out += r.chunk.token_ids
        return out


@pytest.mark.parametrize("bad", ["unknown handle", "stale epoch"])
async def test_bad_transfer_handles_are_recomputed(
    disagg_grpc: DisaggStack, colocated: ServerProcess, tokenizer, bad: str  # type: ignore[no-untyped-def]
) -> None:
    ids = prompt_of_length(tokenizer, 140, salt=f"bad handle {bad}")
    expected = await greedy(colocated.target, ids, 8)
    async with grpc.aio.insecure_channel(disagg_grpc.decode_target) as channel:
        info = await wpb_grpc.DecodeServiceStub(channel).GetWorkerInfo(
            wpb.GetWorkerInfoRequest())
    epoch = info.epoch if bad == "unknown handle" else info.epoch - 1
    metric = "pdserve_kv_transfer_failures_total"
    before = scrape(disagg_grpc.decode_metrics).get(metric, 0.0)
    got = await _decode(disagg_grpc, wpb.DecodeRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=ids, first_token_id=expected[0],
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        handle=wpb.TransferHandle(transfer_id=f"never-sent-{bad.replace(' ', '-')}",
                                  num_tokens=len(ids),
                                  decode_epoch=epoch)))
    assert got == expected[1:]
    assert scrape(disagg_grpc.decode_metrics)[metric] == before + 1


@pytest.mark.parametrize(("field", "value"), [
    ("prompt_token_ids", [-4]), ("first_token_id", 10**6), ("fault", "melt"),
])
async def test_bad_decode_requests_are_refused(
    disagg_grpc: DisaggStack, field: str, value: object
) -> None:
    req = wpb.DecodeRequest(request_id="r-bad", prompt_token_ids=[1, 2, 3], first_token_id=4,
                            sampling=pb.SamplingParams(max_tokens=2),
                            handle=wpb.TransferHandle(transfer_id="x", num_tokens=3))
    if field == "prompt_token_ids":
        del req.prompt_token_ids[:]
        req.prompt_token_ids.extend(value)  # type: ignore[arg-type]
    else:
        setattr(req, field, value)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _decode(disagg_grpc, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await greedy(disagg_grpc.server.target, [1, 2, 3], 2)


async def test_model_info_says_disaggregated(disagg_grpc: DisaggStack) -> None:
    async with PdserveClient(disagg_grpc.server.target) as client:
        info = await client.model_info()
        chat = await client.generate(chat=[("user", "What is the capital of France?")],
                                     temperature=0.0, max_tokens=24)
    assert info.serving_mode == "disaggregated"
    assert info.max_model_len == 2048
    assert "Paris" in chat.text


async def _staged(port: int, want: float, timeout: float = 30.0) -> dict[str, float]:
    """Wait for the decode worker's staged-transfers gauge to read `want`."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(port)
        if m.get("pdserve_kv_staged_transfers") == want or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


LEASE_S = 30.0  # the transfer lease of the test stack (the default)


async def test_staged_transfers_are_gauged_and_released_at_once(
    disagg_grpc: DisaggStack, prefill_stub: wpb_grpc.PrefillServiceStub, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    # A prefill whose decode never comes: its KV waits in the decode worker's staging,
    # which the gauge (read from vLLM's model worker) shows; Release drops it at once
    # rather than when its lease ends, and a Decode that still comes with the handle
    # recomputes the prompt (same tokens).
    async with grpc.aio.insecure_channel(disagg_grpc.decode_target) as channel:
        decode = wpb_grpc.DecodeServiceStub(channel)
        info = await decode.GetWorkerInfo(wpb.GetWorkerInfoRequest())
        ids = prompt_of_length(tokenizer, 200, salt="staged gauge")
        transfer_id = f"staged-{uuid.uuid4().hex}"
        first = await prefill_stub.Prefill(wpb.PrefillRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=ids, transfer_id=transfer_id,
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
            target=wpb.KVTarget(worker_id=info.worker_id, epoch=info.epoch,
                                kv_address=info.kv_address, kv_transport=info.kv_transport,
                                fingerprint_digest=info.fingerprint_digest)))
        held = await _staged(disagg_grpc.decode_metrics, 1.0)
        assert held.get("pdserve_kv_staged_transfers") == 1.0, held
        assert held["pdserve_kv_staged_bytes"] > 0
        released = time.monotonic()
        await decode.Release(wpb.ReleaseRequest(transfer_id=transfer_id))
        after = await _staged(disagg_grpc.decode_metrics, 0.0)
        took = time.monotonic() - released
        assert after["pdserve_kv_staged_transfers"] == 0.0, after
        assert after["pdserve_kv_staged_bytes"] == 0.0
        assert took < LEASE_S / 3, f"freed after {took:.1f} s: by the lease, not by Release"
        await decode.Release(wpb.ReleaseRequest(transfer_id=transfer_id))  # idempotent
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode.Release(wpb.ReleaseRequest(transfer_id="not an id!"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    got = await _decode(disagg_grpc, wpb.DecodeRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=ids, first_token_id=first.first_token_id,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        handle=first.handle))
    expected = await greedy(disagg_grpc.server.target, ids, 8)
    assert [first.first_token_id, *got] == expected


async def test_engine_processes_run_on_tcmalloc_below_the_serving_plane(
        disagg_grpc: DisaggStack) -> None:
    # vLLM's CPU engines are meant to run on tcmalloc (glibc malloc let a prefill
    # engine's RSS grow under long prompts), and at a lower priority than the worker
    # process that answers RPCs and health checks: every engine process of the stack
    # maps tcmalloc and is niced `engine_nice` (10) above its worker.
    import psutil

    from services.engine.config import find_tcmalloc

    assert find_tcmalloc(), "libtcmalloc-minimal4 is missing: `make setup` installs it"
    assert disagg_grpc.server.proc is not None
    engines = [p for p in psutil.Process(disagg_grpc.server.proc.pid).children(recursive=True)
               if p.name().startswith("VLLM::")]
    assert len(engines) >= 4, engines  # an engine core and a model worker per worker
    for p in engines:
        maps = Path(f"/proc/{p.pid}/maps").read_text()
        assert "libtcmalloc" in maps, f"{p.name()} ({p.pid}) does not run on tcmalloc"
        worker = next(a for a in p.parents() if not a.name().startswith("VLLM::"))
        assert p.nice() == min(19, worker.nice() + 10), (p.name(), p.nice(), worker.nice())
