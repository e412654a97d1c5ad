"""`pdserve up | scale | down` on a real local Ray cluster, with its own redis-server
and real vLLM workers as Ray actors: one default stack for the whole module, driven
through crashes, hangs, a Redis kill and poisoned cluster state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import psutil
import pytest
import redis as sync_redis
from prometheus_client.parser import text_string_to_metric_families

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services.api.client import PdserveClient
from services.bench.procstats import scrape_samples
from services.launcher.planning import decode_pages
from services.launcher.scale import set_desired
from services.plan.live import TrafficMeter
from services.registry.records import WorkerRecord
from services.registry.registry import Registry
from services.registry.signing import RecordSigner
from services.security.certs import internal_files
from services.server.channels import dial
from tests.helpers.prompts import prompt_of_length
from tests.helpers.servers import ServerProcess, free_port, scrape, stop_group
from tests.helpers.sockets import Listener, listeners, pid_listening_on, tree

pytestmark = [pytest.mark.engine, pytest.mark.slow]
DRAIN_TOKENS = 400  # a stream that outlasts the scale-down (a second or two) on a fast host

# Ray's own listeners, which take no bind address: a local cluster is a single-node one,
# where they follow its loopback node address (services/launcher/ray_cluster.py); one that
# does not is reported (printed) but tolerated, being covered by Ray's token authentication.
# Matched on the process title Ray sets, or on the script a Python process runs. Ray's
# autoscaler monitor is not among them: its metrics have no authentication.
RAY_PROCESSES = {
    "gcs_server": "Ray's GCS (cluster metadata, actor table)",
    "raylet": "Ray's raylet (node manager, object manager)",
    "ray::RuntimeEnvAgent": "Ray's runtime-env agent",
    "ray::DashboardAgent": "Ray's per-node agent (metrics, events)",
    "ray::IDLE": "an idle Ray worker's core-worker gRPC port",
    "ray::ServiceActor": "the actor's core-worker gRPC port (Ray's actor calls)",
}
RAY_SCRIPTS = {
    "ray/dashboard/agent.py": "Ray's per-node agent (metrics, events)",
    "ray/_private/log_monitor.py": "Ray's log monitor",
}


def ray_reason(s: Listener, driver_pid: int) -> str | None:
    """Why a listener beyond loopback is Ray's, or None when it is not."""
    if s.process in RAY_PROCESSES:
        return RAY_PROCESSES[s.process]
    if s.pid == driver_pid:
        return "the driver's core-worker gRPC port (in `pdserve up` itself)"
    if not s.process.startswith("python"):
        return None
    args = s.cmdline.split()
    return next((why for part, why in RAY_SCRIPTS.items()
                 if any(a.endswith(part) for a in args[1:3])), None)


class Up:
    """A default `pdserve up --prefill 1 --decode 1`: its own redis-server (password),
    its own cluster secret; only ports and the state file are chosen by the test."""

    def __init__(self, workdir: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.supervisor_port = free_port()
        self.state_file = workdir / "up-state.json"
        self.log = workdir / "up.log"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("PDSERVE_CLUSTER_SECRET")}
        self.env["PDSERVE_STATE_FILE"] = str(self.state_file)
        self.env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--prefill", "1", "--decode", "1",
             "--port", str(self.port), "--metrics-port", str(self.metrics_port),
             "--kv-cache-gib", "1", "--worker-ttl-s", "3",
             "--supervisor-metrics-port", str(self.supervisor_port), "--grace-s", "120",
             "--actor-probe-interval-s", "1", "--actor-probe-timeout-s", "3", *extra],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
            env=self.env)

    def state(self) -> dict[str, str]:
        deadline = time.monotonic() + 120
        while not self.state_file.exists():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no state file"
            time.sleep(0.2)
        return dict(json.loads(self.state_file.read_text()))

    @property
    def redis_url(self) -> str:
        return self.state()["redis_url"]

    @property
    def signer(self) -> RecordSigner:
        return RecordSigner(self.state()["cluster_secret"].encode())

    def registry(self) -> Registry:
        return Registry.from_url(self.redis_url, signer=self.signer)

    async def records(self) -> list[WorkerRecord]:
        registry = self.registry()
        try:
            return await registry.workers()
        finally:
            await registry.close()

    @contextlib.asynccontextmanager
    async def serving(self, workers: int = 2) -> AsyncIterator[Up]:
        """The stack once it answers and `workers` workers registered; its whole process
        group is stopped when the block ends (a module fixture's teardown)."""
        try:
            await self.wait_serving(timeout=900)
            await self.wait_until(lambda rs: len(rs) == workers, 120,
                                  f"the {workers} workers to register")
            yield self
        finally:
            stop_group(self.proc, timeout=120)

    async def wait_serving(self, timeout: float) -> None:
        """Until the router says SERVING. A fresh stack restarts no actor on its way
        there: an engine that fails to start (and would be restarted for as long as the
        wait lasts) fails the wait at once, with the launcher's log, which carries the
        actors' output."""
        deadline = time.monotonic() + timeout
        async with PdserveClient(f"127.0.0.1:{self.port}") as client:
            while True:
                assert self.proc.poll() is None, self.log.read_text(errors="replace")[-6000:]
                with contextlib.suppress(OSError):
                    restarts = sum(v for name, v in scrape_samples(self.supervisor_port)
                                   if name == "pdserve_supervisor_restarts_total")
                    assert not restarts, ("an actor was restarted before the stack served:\n"
                                          + self.log.read_text(errors="replace")[-12000:])
                with contextlib.suppress(TimeoutError):
                    await client.wait_ready(timeout=5)
                    return
                assert time.monotonic() < deadline, (
                    f"not SERVING after {timeout:.0f} s:\n"
                    + self.log.read_text(errors="replace")[-6000:])

    async def wait_until(self, predicate: Callable[[list[WorkerRecord]], bool],
                         timeout: float, what: str) -> list[WorkerRecord]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                records = await self.records()
            except Exception:  # Redis restarting
                records = []
            if predicate(records):
                return records
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.5)

    def dial(self, address: str) -> grpc.aio.Channel:
        """A channel to one of the stack's workers, as its router (the stack's own CA:
        internal ports are mutual TLS)."""
        files = internal_files(self.state()["tls_dir"], "router")
        return dial(address, files)

    def pdserve(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "services.cli", *args],
                              capture_output=True, text=True, timeout=90, env=self.env)

    def restarts(self, **labels: str) -> float:
        return scrape(self.supervisor_port, **labels).get("pdserve_supervisor_restarts_total",
                                                           0.0)


@pytest.fixture(scope="module")
async def up(session_dir: Path, model_path: Path) -> AsyncIterator[Up]:
    stack = Up(session_dir)
    async with stack.serving() as running:
        yield running


async def generate(up: Up, tokenizer, salt: str, tokens: int = 3):  # type: ignore[no-untyped-def]
    async with PdserveClient(f"127.0.0.1:{up.port}") as client:
        return await client.generate(token_ids=prompt_of_length(tokenizer, 90, salt=salt),
                                     temperature=0.0, max_tokens=tokens, ignore_eos=True)


async def test_up_answers_like_colocated(up: Up, colocated: ServerProcess, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = prompt_of_length(tokenizer, 260, salt="ray identity")
    async with PdserveClient(colocated.target) as c1, \
            PdserveClient(f"127.0.0.1:{up.port}") as c2:
        a = await c1.generate(token_ids=ids, temperature=0.0, max_tokens=10, ignore_eos=True)
        b = await c2.generate(token_ids=ids, temperature=0.0, max_tokens=10, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert b.timings["kv_transfer_bytes"] > 0


async def test_the_live_planner_reads_what_the_decode_worker_finished(up: Up, tokenizer) -> None:  # type: ignore[no-untyped-def]
    # What `pdserve up --planner-profile` observes: the decode worker's vLLM histograms
    # count each request once, with its whole prompt (whose KV was shipped to it) and its
    # output, shifted by the token the prefill worker generated: prompt + 1, output - 1.
    sent = [(90, 3), (150, 5)]
    registry = up.registry()
    try:
        meter = TrafficMeter()
        assert meter.window(await decode_pages(registry), time.monotonic()) is None
        async with PdserveClient(f"127.0.0.1:{up.port}") as client:
            for i, (n, k) in enumerate(sent):
                await client.generate(token_ids=prompt_of_length(tokenizer, n, salt=f"plan {i}"),
                                      temperature=0.0, max_tokens=k, ignore_eos=True)
        requests, prompt, output = 0, 0.0, 0.0
        deadline = time.monotonic() + 15  # vLLM records a request's stats after its last token
        while requests < len(sent) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            t = meter.window(await decode_pages(registry), time.monotonic())
            assert t is not None
            requests, prompt, output = (requests + t.requests, prompt + t.prompt.total,
                                        output + t.output.total)
    finally:
        await registry.close()
    assert (requests, prompt, output) == (2, 240 + 2, 8 - 2)


async def test_every_pdserve_port_of_a_default_stack_is_on_loopback(up: Up) -> None:
    records = await up.records()
    redis_port = int(up.redis_url.rsplit(":", 1)[1].split("/")[0])
    ours = {up.port: "router gRPC", up.metrics_port: "router metrics",
            up.supervisor_port: "supervisor metrics", redis_port: "redis-server"}
    for w in records:
        ours[int(w.address.rsplit(":", 1)[1])] = f"{w.worker_id} gRPC"
        if w.metrics_port:
            ours[w.metrics_port] = f"{w.worker_id} metrics"
        if w.kv_address:
            ours[int(w.kv_address.rsplit(":", 1)[1])] = f"{w.worker_id} KV receiver"
    sockets = listeners(up.proc.pid)
    problems = []
    for port, what in sorted(ours.items()):
        bound = [s for s in sockets if s.port == port]
        if not bound:
            problems.append(f"{what}: nobody listens on {port}")
        problems += [f"{what}: {s} is beyond loopback" for s in bound if not s.loopback]
    exceptions = []
    for s in sockets:
        if s.loopback or s.port in ours:
            continue
        reason = ray_reason(s, up.proc.pid)
        if reason is None:
            problems.append(f"unexpected listener beyond loopback: {s} {s.cmdline[:120]}")
        else:
            exceptions.append(f"{s}: {reason}")
    print("Ray's listeners beyond loopback (token-authenticated):", *exceptions, sep="\n  ")
    assert not problems, "\n".join(problems)


async def test_poisoned_records_neither_stop_serving_nor_receive_requests(
        up: Up, tokenizer) -> None:  # type: ignore[no-untyped-def]
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.setblocking(False)
    trap_address = f"127.0.0.1:{trap.getsockname()[1]}"
    registry = up.registry()
    # A Redis writer without the cluster secret: a forged decode and prefill worker
    # pointing at the trap, a record that is not JSON, one with wrong types.
    forger = Registry(registry.redis, signer=RecordSigner(b"a-guessed-secret-0123456789"))
    (decode,) = [w for w in await registry.workers() if w.role == "decode"]
    fields = {**decode.to_dict(), "address": trap_address, "updated": time.time(),
              "load": {}}
    poison = {
        "evil-decode": forger.signer.seal("worker", {**fields, "worker_id": "evil-decode"}),
        "evil-prefill": forger.signer.seal("worker", {**fields, "worker_id": "evil-prefill",
                                                      "role": "prefill"}),
        "evil-json": b"{\x00 not json",
        "evil-types": up.signer.seal("worker", {**fields, "worker_id": "evil-types",
                                                "epoch": [1], "capacity": "lots"}),
    }
    before = {r: scrape(up.metrics_port, reason=r).get("pdserve_registry_bad_records_total",
                                                        0.0)
              for r in ("json", "schema", "signature")}
    try:
        for worker_id, value in poison.items():
            await registry.redis.set(f"{registry.ns}w:{worker_id}", value, ex=600)
            await registry.redis.sadd(f"{registry.ns}workers", worker_id)
        await asyncio.sleep(1.5)  # several refreshes of the router's view
        for i in range(6):
            assert (await generate(up, tokenizer, f"poison {i}")).completion_tokens == 3
        with pytest.raises(BlockingIOError):
            trap.accept()  # no request ever reached the forged workers
        after = {r: scrape(up.metrics_port, reason=r).get(
            "pdserve_registry_bad_records_total", 0.0) for r in before}
        assert after["signature"] - before["signature"] == 2
        assert after["json"] - before["json"] == 1
        assert after["schema"] - before["schema"] == 1

        # A router that starts while the poison is there comes up and serves.
        router_pid = pid_listening_on(up.proc.pid, up.port)
        os.kill(router_pid, signal.SIGKILL)
        async with PdserveClient(f"127.0.0.1:{up.port}") as client:
            await client.wait_ready(timeout=300)
        assert pid_listening_on(up.proc.pid, up.port) != router_pid
        assert (await generate(up, tokenizer, "poison after restart")).completion_tokens == 3
        with pytest.raises(BlockingIOError):
            trap.accept()
    finally:
        for worker_id in poison:
            await registry.deregister(worker_id)
        await registry.close()
        trap.close()


async def test_crashed_worker_is_restarted_with_a_new_epoch(up: Up, tokenizer) -> None:  # type: ignore[no-untyped-def]
    (old,) = [w for w in await up.records() if w.role == "decode"]
    crashed = up.restarts(role="decode", reason="crashed")
    os.kill(old.pid, signal.SIGKILL)
    new = (await up.wait_until(
        lambda rs: any(w.role == "decode" and w.epoch != old.epoch for w in rs), 300,
        "the decode worker to come back"))
    (restarted,) = [w for w in new if w.role == "decode"]
    assert restarted.worker_id == old.worker_id and restarted.pid != old.pid
    # a handle minted for the old epoch is refused: the worker recomputes the prompt
    metric = "pdserve_kv_transfer_failures_total"
    before = scrape(restarted.metrics_port).get(metric, 0.0)
    async with up.dial(restarted.address) as channel:
        async for _ in wpb_grpc.DecodeServiceStub(channel).Decode(wpb.DecodeRequest(
                request_id="handle-of-an-old-epoch", prompt_token_ids=[1, 2, 3, 4],
                first_token_id=5,
                sampling=pb.SamplingParams(max_tokens=2, temperature=0.0),
                handle=wpb.TransferHandle(transfer_id="from-before", num_tokens=4,
                                          decode_epoch=old.epoch))):
            pass
    assert scrape(restarted.metrics_port)[metric] == before + 1
    assert (await generate(up, tokenizer, "after crash")).completion_tokens == 3
    # the supervisor saw Ray's restart (its probe finds the new process within seconds)
    deadline = time.monotonic() + 30
    while up.restarts(role="decode", reason="crashed") < crashed + 1:
        assert time.monotonic() < deadline, "the supervisor never noticed the restart"
        await asyncio.sleep(0.5)


async def test_supervisor_restarts_a_hung_worker(up: Up, tokenizer) -> None:  # type: ignore[no-untyped-def]
    (old,) = [w for w in await up.records() if w.role == "prefill"]
    hangs = up.restarts(role="prefill", reason="hang")
    os.kill(old.pid, signal.SIGSTOP)  # alive to Ray, deaf to everyone
    try:
        new = await up.wait_until(
            lambda rs: any(w.role == "prefill" and w.epoch != old.epoch for w in rs), 300,
            "the hung prefill worker to be replaced")
    finally:
        if psutil.pid_exists(old.pid):
            os.kill(old.pid, signal.SIGCONT)
    (restarted,) = [w for w in new if w.role == "prefill"]
    assert restarted.pid != old.pid
    assert up.restarts(role="prefill", reason="hang") == hangs + 1
    assert not psutil.pid_exists(old.pid) or psutil.Process(old.pid).status() == "zombie"
    r = await generate(up, tokenizer, "after the hang")
    assert r.completion_tokens == 3


async def test_redis_killed_is_restarted_and_scale_still_works(up: Up, tokenizer) -> None:  # type: ignore[no-untyped-def]
    redis_port = int(up.redis_url.rsplit(":", 1)[1].split("/")[0])
    (server,) = [p for p in tree(up.proc.pid) if p.name() == "redis-server"]
    assert pid_listening_on(up.proc.pid, redis_port) == server.pid
    server.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # serving goes on from the router's last view while Redis is away and refills
    assert (await generate(up, tokenizer, "redis away")).completion_tokens == 3
    await up.wait_until(lambda rs: {w.role for w in rs} == {"prefill", "decode"}, 60,
                        "workers to re-register in the restarted Redis")
    assert time.monotonic() - killed < 60
    (again,) = [p for p in tree(up.proc.pid) if p.name() == "redis-server"]
    assert again.pid != server.pid
    metrics = scrape(up.supervisor_port)
    assert metrics["pdserve_supervisor_redis_restarts_total"] == 1
    # the same URL and password still work, and the desired sizes are back
    assert sync_redis.Redis.from_url(up.redis_url).get("pdserve:desired") is not None
    out = up.pdserve("scale", "--decode", "1")
    assert out.returncode == 0, out.stderr
    assert "1 prefill, 1 decode" in out.stdout
    assert (await generate(up, tokenizer, "redis back")).completion_tokens == 3


async def test_a_forged_desired_state_is_ignored(up: Up) -> None:
    client = sync_redis.Redis.from_url(up.redis_url)
    forged = RecordSigner(b"a-guessed-secret-0123456789").seal(
        "desired", {"prefill": 0, "decode": 1, "routers": 1, "down": True})
    client.set("pdserve:desired", forged)
    await asyncio.sleep(3)
    assert up.proc.poll() is None
    records = await up.records()
    assert {w.role for w in records} == {"prefill", "decode"}
    # the launcher put its own (signed) state back
    assert up.signer.open("desired", client.get("pdserve:desired"))["down"] is False


def migrations(up: Up) -> float:
    """Streams the router moved to another worker, whatever the reason."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{up.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pdserve_migrations_total")


async def test_a_worker_scaled_away_finishes_its_streams_first(  # type: ignore[no-untyped-def]
        up: Up, colocated: ServerProcess, tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    # `pdserve scale` (and the live planner) drain a worker before ending it: it leaves
    # the registry at once, so nothing new reaches it, and the streams it is serving
    # finish there, token-identical to colocated, without a migration.
    out = up.pdserve("scale", "--decode", "2")
    assert "2 decode" in out.stdout, out.stderr
    await up.wait_until(lambda rs: sum(w.role == "decode" for w in rs) == 2, 600,
                        "a second decode worker")
    prompts = [prompt_of_length(tokenizer, 100, salt=f"drain {i}") for i in range(2)]
    migrated = migrations(up)
    first_token = [asyncio.Event() for _ in prompts]

    async def stream(i: int) -> list[int]:
        got: list[int] = []
        async with PdserveClient(f"127.0.0.1:{up.port}") as client:
            async for piece in client.stream(token_ids=prompts[i], temperature=0.0,
                                             max_tokens=DRAIN_TOKENS, ignore_eos=True):
                got += piece.token_ids
                first_token[i].set()
        return got

    # One stream on each decode worker: the second starts once the first one's worker
    # reports it running, so the router's load policy sends it to the other.
    streams = [asyncio.create_task(stream(0))]
    await first_token[0].wait()
    await up.wait_until(lambda rs: any(w.role == "decode" and w.load.running for w in rs), 30,
                        "the first stream's worker to report it")
    await asyncio.sleep(1.0)  # the router's view refreshes every 0.5 s
    streams.append(asyncio.create_task(stream(1)))
    await up.wait_until(lambda rs: [w.load.running for w in rs if w.role == "decode"] == [1, 1],
                        30, "one stream running on each decode worker")
    # What `pdserve scale --decode 1` does, in this process: a child process started now
    # competes for the CPU with two busy engines on a 2-core host.
    monkeypatch.setenv("PDSERVE_STATE_FILE", str(up.state_file))
    await set_desired(up.redis_url, {"decode": 1})
    await up.wait_until(lambda rs: not any(w.worker_id == "decode-1" for w in rs), 60,
                        "decode-1 to leave the registry")
    still_running = sum(not s.done() for s in streams)
    got = await asyncio.gather(*streams)
    print(f"{still_running} of 2 streams were running when decode-1 left the registry")
    async with PdserveClient(colocated.target) as ref:
        want = [(await ref.generate(token_ids=ids, temperature=0.0, max_tokens=DRAIN_TOKENS,
                                    ignore_eos=True)).token_ids for ids in prompts]
    assert got == want
    assert migrations(up) == migrated
    r = await generate(up, tokenizer, "after the drain")
    assert r.completion_tokens == 3


async def test_scale_at_run_time_then_down(up: Up, tokenizer) -> None:  # type: ignore[no-untyped-def]
    out = up.pdserve("scale", "--prefill", "0")
    assert "0 prefill" in out.stdout, out.stderr
    await up.wait_until(lambda rs: not any(w.role == "prefill" for w in rs), 60,
                        "the prefill worker to stop")
    async with PdserveClient(f"127.0.0.1:{up.port}") as client:
        # no prefill pool: the decode worker prefills itself (conditional disaggregation)
        r = await client.generate(token_ids=prompt_of_length(tokenizer, 120, salt="no P"),
                                  temperature=0.0, max_tokens=3, ignore_eos=True)
    assert r.completion_tokens == 3 and r.timings.get("kv_transfer_bytes", 0) == 0
    assert scrape(up.metrics_port, decision="local")[
        "pdserve_router_disaggregation_decisions_total"] >= 1
    out = up.pdserve("down")
    assert out.returncode == 0, out.stderr
    assert up.proc.wait(timeout=120) == 0
    assert not up.state_file.exists()
    deadline = time.monotonic() + 30
    while "ray::ServiceActor" in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                                text=True).stdout:
        assert time.monotonic() < deadline, "actors left running after `pdserve down`"
        await asyncio.sleep(0.5)
    out = up.pdserve("down")
    assert out.returncode == 1 and "Traceback" not in out.stderr
