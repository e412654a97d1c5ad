"""Traces from a real stack to a real OTLP receiver: `pdserve serve --mode disagg` (the
router backend over a prefill and a decode worker, real vLLM engines, the KV shipped
over gRPC), started with `--otlp-traces-endpoint` pointing at a `TraceService` in this
test. One request is one trace: the router's span with the prefill, KV transfer and
decode spans as its children, the transfer's bytes equal to what the response reports
and its chunks and checksum time as the receiver measured them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.api.client import PdserveClient
from services.registry.redis_server import RedisServer
from tests.helpers.otlp_receiver import OtlpReceiver, Received
from tests.helpers.prompts import prompt_of_length
from tests.helpers.servers import DisaggStack

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
NAMES = {"pdserve.router", "pdserve.prefill", "pdserve.kv_transfer", "pdserve.decode"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
async def traced(model_path: Path, session_dir: Path, receiver: OtlpReceiver,
                 redis: RedisServer) -> AsyncIterator[DisaggStack]:
    """The disaggregated stack the other disagg tests use, with tracing on: the flag on
    the front, forwarded to both workers; a short export delay so spans arrive fast.
    Its workers also register in a real redis-server, for `pdserve top`."""
    stack = DisaggStack.create(session_dir / "disagg-traced.log", "grpc")
    stack.server.args += ["--otlp-traces-endpoint", receiver.endpoint,
                          "--otlp-sampling-ratio", "1", "--redis-url", redis.url]
    stack.server.env = {"OTEL_BSP_SCHEDULE_DELAY": "100",
                        # the workers sign their records in Redis
                        "PDSERVE_CLUSTER_SECRET": "tracing-tests-cluster-secret"}
    async with stack.server.running(timeout=600):
        yield stack


def spans_of(receiver: OtlpReceiver, request_id: str) -> dict[str, Received]:
    """The spans of the one trace that request went into, by name (each exactly once)."""
    receiver.wait_for(NAMES, request_id=request_id)
    traces = {s.trace_id for s in receiver.spans
              if s.attributes.get("gen_ai.request.id") == request_id}
    assert len(traces) == 1, traces
    (trace,) = traces
    mine = [s for s in receiver.spans if s.trace_id == trace]
    assert sorted(s.name for s in mine) == sorted(NAMES), [s.name for s in mine]
    return {s.name: s for s in mine}


async def generate(stack: DisaggStack, tokenizer, traceparent: str = "",  # type: ignore[no-untyped-def]
                   salt: str = "trace") -> tuple[str, dict[str, float]]:
    """One greedy request; returns pdserve's request id (the Final's, as the client set
    none) and the timings."""
    async with PdserveClient(stack.server.target) as client:
        if traceparent:
            client.metadata = (*client.metadata, ("traceparent", traceparent))
        done = await client.generate(token_ids=prompt_of_length(tokenizer, 300, salt=salt),
                                     temperature=0.0, max_tokens=6, ignore_eos=True)
    assert done.completion_tokens == 6 and done.request_id
    return done.request_id, done.timings


async def test_one_request_is_one_trace_nested_under_the_clients_span(
        traced: DisaggStack, receiver: OtlpReceiver, tokenizer) -> None:  # type: ignore[no-untyped-def]
    receiver.clear()
    request_id, timings = await generate(traced, tokenizer,
                                         f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", salt="nested")
    spans = spans_of(receiver, request_id)
    router = spans["pdserve.router"]
    assert router.trace_id == CLIENT_TRACE and router.parent_span_id == CLIENT_SPAN
    for name in ("pdserve.prefill", "pdserve.kv_transfer", "pdserve.decode"):
        assert spans[name].parent_span_id == router.span_id, name
    assert {s.service for s in spans.values()} == {"pdserve-router", "pdserve-prefill",
                                                  "pdserve-decode"}
    kv = spans["pdserve.kv_transfer"].attributes
    assert kv["pdserve.kv.ok"] is True and kv["pdserve.kv.transport"] == "grpc"
    assert kv["pdserve.kv.bytes"] == timings["kv_transfer_bytes"] > 0
    # Measured by the receiver: gRPC data frames of at most 1 MiB, each checksummed.
    assert kv["pdserve.kv.chunks"] >= max(1, kv["pdserve.kv.bytes"] // (1 << 20))
    assert kv["pdserve.kv.checksum_s"] > 0
    assert kv["pdserve.kv.staged_s"] >= 0
    # (The client's timings leave out fields that are zero.)
    assert kv["pdserve.kv.hidden_s"] == pytest.approx(timings.get("kv_transfer_hidden_s", 0.0))
    assert kv["pdserve.kv.duration_s"] == pytest.approx(timings.get("kv_transfer_s", 0.0))
    assert kv["pdserve.kv.exposed_s"] == pytest.approx(
        kv["pdserve.kv.duration_s"] - kv["pdserve.kv.hidden_s"])
    assert kv["pdserve.kv.prefill_worker"] == "local-prefill"
    assert kv["pdserve.kv.decode_worker"] == "local-decode"
    r = router.attributes
    assert r["pdserve.route.prefill_worker"] == "local-prefill"
    assert r["pdserve.route.decode_worker"] == "local-decode"
    assert r["gen_ai.usage.completion_tokens"] == 6 and r["gen_ai.usage.prompt_tokens"] == 300
    assert [e for e, _ in router.events][:2] == ["admitted", "pair_chosen"]
    assert "first_token" in [e for e, _ in router.events]
    d = spans["pdserve.decode"].attributes
    assert d["gen_ai.usage.completion_tokens"] == 5  # token 1 came from the prefill worker
    assert d["pdserve.decode.steps"] >= 1 and d["pdserve.decode.local_prefill"] is False
    p = spans["pdserve.prefill"].attributes
    assert p["gen_ai.latency.time_in_model_prefill"] == pytest.approx(
        timings.get("prefill_s", 0.0))
    # In time, the children start inside the router's span (one machine, one clock); the
    # prefill span ends before its answer reaches the router.
    for name in NAMES - {"pdserve.router"}:
        assert router.start_ns <= spans[name].start_ns <= router.end_ns, name
    assert spans["pdserve.prefill"].end_ns <= router.end_ns


async def test_without_traceparent_a_request_starts_a_new_trace(
        traced: DisaggStack, receiver: OtlpReceiver, tokenizer) -> None:  # type: ignore[no-untyped-def]
    receiver.clear()
    ids = [(await generate(traced, tokenizer, salt=f"new trace {i}"))[0] for i in range(2)]
    routers = [spans_of(receiver, request_id)["pdserve.router"] for request_id in ids]
    assert all(s.parent_span_id == "" for s in routers)  # roots: no parent
    assert len({s.trace_id for s in routers}) == 2 and CLIENT_TRACE not in {
        s.trace_id for s in routers}


async def test_an_unsampled_request_sends_nothing_from_any_process(
        traced: DisaggStack, receiver: OtlpReceiver, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The client's traceparent says "not sampled": the router follows it, and its
    decision travels to both workers, so no process sends a span."""
    unsampled = "1" * 32
    quiet, _ = await generate(traced, tokenizer, f"00-{unsampled}-{CLIENT_SPAN}-00",
                              salt="quiet")
    # A sampled request after it: once its spans are all in, anything the quiet one
    # had sent (the same processes, the same exporters) would be in too.
    loud, _ = await generate(traced, tokenizer, f"00-{'2' * 32}-{CLIENT_SPAN}-01", salt="loud")
    assert spans_of(receiver, loud)["pdserve.router"].trace_id == "2" * 32
    assert not [s for s in receiver.spans if s.trace_id == unsampled
                or s.attributes.get("gen_ai.request.id") == quiet]


async def test_http_front_takes_the_clients_traceparent(
        traced: DisaggStack, receiver: OtlpReceiver) -> None:
    trace = "3" * 32
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{traced.server.base_url}/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          "traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
    deadline = time.monotonic() + 60
    while not (routers := [s for s in receiver.spans if s.trace_id == trace
                           and s.name == "pdserve.router"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert routers, "no router span in the client's trace"
    spans = spans_of(receiver, str(routers[0].attributes["gen_ai.request.id"]))
    assert spans["pdserve.router"].parent_span_id == CLIENT_SPAN


async def test_top_shows_the_stacks_real_workers(traced: DisaggStack, redis: RedisServer,
                                                 tokenizer) -> None:  # type: ignore[no-untyped-def]
    """`pdserve top --once --json` against this stack's real workers (their records in
    Redis, their vLLM and pdserve metrics), while requests run."""
    async def load() -> None:
        for i in range(3):
            await generate(traced, tokenizer, salt=f"top {i}")

    task = asyncio.create_task(load())
    out = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "services.cli", "top", "--redis-url", redis.url, "--once",
        "--json", "--interval", "2"], capture_output=True, text=True, timeout=120)
    await task
    assert out.returncode == 0, out.stderr
    rows = {r["worker_id"]: r for r in json.loads(out.stdout)["workers"]}
    assert set(rows) == {"local-prefill", "local-decode"}
    for worker_id, role in (("local-prefill", "prefill"), ("local-decode", "decode")):
        row = rows[worker_id]
        assert row["role"] == role and row["metrics"] is True and row["errors"] == 0
        assert row["epoch"] >= 1 and row["capacity"] >= 1
        assert row["prompt_tokens_per_s"] is not None and row["prompt_tokens_per_s"] >= 0
    assert rows["local-decode"]["kv_gbytes_per_s"] is not None
