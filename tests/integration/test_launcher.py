"""`pdserve up | scale | down` on a real local Ray cluster, with a real redis-server and
real vLLM workers as Ray actors."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services.api.client import PdserveClient
from services.registry.records import WorkerRecord
from services.registry.redis_server import RedisServer
from services.registry.registry import Registry
from tests.helpers.prompts import prompt_of_length
from tests.helpers.servers import ServerProcess, free_port, scrape, stop_group

pytestmark = pytest.mark.engine


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True,
                          text=True, timeout=60, check=True)


class Up:
    def __init__(self, redis: RedisServer, log: Path) -> None:
        self.redis = redis
        self.port = free_port()
        self.metrics_port = free_port()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--prefill", "1", "--decode", "1",
             "--redis-url", redis.url, "--host", "127.0.0.1", "--port", str(self.port),
             "--metrics-port", str(self.metrics_port), "--kv-cache-gib", "1",
             "--worker-ttl-s", "3"],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

    async def records(self) -> list[WorkerRecord]:
        registry = Registry.from_url(self.redis.url)
        try:
            return await registry.workers()
        finally:
            await registry.close()

    async def wait_until(self, predicate, timeout: float, what: str) -> list[WorkerRecord]:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            records = await self.records()
            if predicate(records):
                return records
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
async def up(redis: RedisServer, session_dir: Path, model_path: Path) -> AsyncIterator[Up]:
    stack = Up(redis, session_dir / "up.log")
    try:
        async with PdserveClient(f"127.0.0.1:{stack.port}") as client:
            await client.wait_ready(timeout=900)
        yield stack
    finally:
        stop_group(stack.proc, timeout=120)


async def test_up_answers_like_colocated(up: Up, colocated: ServerProcess, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = prompt_of_length(tokenizer, 260, salt="ray identity")
    async with PdserveClient(colocated.target) as c1, \
            PdserveClient(f"127.0.0.1:{up.port}") as c2:
        a = await c1.generate(token_ids=ids, temperature=0.0, max_tokens=10, ignore_eos=True)
        b = await c2.generate(token_ids=ids, temperature=0.0, max_tokens=10, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert b.timings["kv_transfer_bytes"] > 0


async def test_crashed_worker_is_restarted_with_a_new_epoch(up: Up, tokenizer) -> None:  # type: ignore[no-untyped-def]
    (old,) = [w for w in await up.records() if w.role == "decode"]
    os.kill(old.pid, signal.SIGKILL)
    new = (await up.wait_until(
        lambda rs: any(w.role == "decode" and w.epoch != old.epoch for w in rs), 300,
        "the decode worker to come back"))
    (restarted,) = [w for w in new if w.role == "decode"]
    assert restarted.worker_id == old.worker_id and restarted.pid != old.pid
    # a handle minted for the old epoch is refused: the worker recomputes the prompt
    metric = "pdserve_kv_transfer_failures_total"
    before = scrape(restarted.metrics_port).get(metric, 0.0)
    async with grpc.aio.insecure_channel(restarted.address) as channel:
        async for _ in wpb_grpc.DecodeServiceStub(channel).Decode(wpb.DecodeRequest(
                prompt_token_ids=[1, 2, 3, 4], first_token_id=5,
                sampling=pb.SamplingParams(max_tokens=2, temperature=0.0),
                handle=wpb.TransferHandle(transfer_id="from-before", num_tokens=4,
                                          decode_epoch=old.epoch))):
            pass
    assert scrape(restarted.metrics_port)[metric] == before + 1
    async with PdserveClient(f"127.0.0.1:{up.port}") as client:
        r = await client.generate(token_ids=prompt_of_length(tokenizer, 90, salt="after crash"),
                                  temperature=0.0, max_tokens=3, ignore_eos=True)
    assert r.completion_tokens == 3


async def test_scale_at_run_time_then_down(up: Up, tokenizer) -> None:  # type: ignore[no-untyped-def]
    out = pdserve("scale", "--prefill", "0", "--redis-url", up.redis.url)
    assert "0 prefill" in out.stdout
    await up.wait_until(lambda rs: not any(w.role == "prefill" for w in rs), 60,
                        "the prefill worker to stop")
    async with PdserveClient(f"127.0.0.1:{up.port}") as client:
        # no prefill pool: the decode worker prefills itself (conditional disaggregation)
        r = await client.generate(token_ids=prompt_of_length(tokenizer, 120, salt="no P"),
                                  temperature=0.0, max_tokens=3, ignore_eos=True)
    assert r.completion_tokens == 3 and r.timings.get("kv_transfer_bytes", 0) == 0
    assert scrape(up.metrics_port, decision="local")[
        "pdserve_router_disaggregation_decisions_total"] >= 1
    pdserve("down", "--redis-url", up.redis.url)
    assert up.proc.wait(timeout=120) == 0
    deadline = time.monotonic() + 30
    while "ray::ServiceActor" in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                                text=True).stdout:
        assert time.monotonic() < deadline, "actors left running after `pdserve down`"
        await asyncio.sleep(0.5)
