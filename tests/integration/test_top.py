"""`pdserve top` against a real redis-server holding worker records written by the real
registry, and real Prometheus endpoints over HTTP. The endpoints serve counters the test
sets (named `FakeWorkerMetrics`: they stand in for the workers' vLLM metrics so every
figure can be checked exactly); the stack test in test_tracing.py reads real workers.

The last tests run a real `pdserve up` stack (Ray actors, its own redis-server and
cluster secret) and read it the way a user does: the Prometheus targets file it writes,
each target's /metrics, and `pdserve top` with nothing but the stack's state file."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from services.api.client import PdserveClient
from services.observability.fleet import Fleet, Row
from services.observability.top import COLUMNS
from services.registry.records import WorkerLoad, WorkerRecord
from services.registry.redis_server import RedisServer
from services.registry.registry import Registry
from services.registry.signing import RecordSigner
from services.server.channels import free_port
from tests.helpers.prompts import prompt_of_length
from tests.integration.test_launcher import Up


class FakeWorkerMetrics:
    """A Prometheus endpoint with the counters top reads, set by the test."""

    def __init__(self, *, migrations: bool = False) -> None:
        self.port = free_port()
        reg = CollectorRegistry()
        self.prompt = Counter("vllm:prompt_tokens", "", registry=reg)
        self.generation = Counter("vllm:generation_tokens", "", registry=reg)
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "", registry=reg)
        self.kv_failures = Counter("pdserve_kv_transfer_failures", "", ["policy"], registry=reg)
        self.finished = Counter("vllm:request_success", "", ["finished_reason"], registry=reg)
        self.migrations = (
            Counter("pdserve_migrations", "", ["reason", "worker"], registry=reg)
            if migrations
            else None
        )
        self.server, self.thread = start_http_server(self.port, "127.0.0.1", registry=reg)

    def stop(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def endpoints() -> Iterator[dict[str, FakeWorkerMetrics]]:
    eps = {
        "prefill-a": FakeWorkerMetrics(),
        "decode-a": FakeWorkerMetrics(),
        "router": FakeWorkerMetrics(migrations=True),
    }
    yield eps
    for ep in eps.values():
        ep.stop()


def record(
    worker_id: str, role: str, metrics_port: int, epoch: int = 1, load: WorkerLoad | None = None
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,
        address=f"127.0.0.1:{free_port()}",
        host="node-1",
        epoch=epoch,
        fingerprint="f" * 16,
        kv_address="127.0.0.1:1" if role == "decode" else "",
        kv_transport="grpc" if role == "decode" else "",
        metrics_port=metrics_port,
        capacity=8,
        load=load or WorkerLoad(),
        updated=time.time(),
    )


@pytest.fixture
async def registry(redis: RedisServer) -> Iterator[Registry]:  # type: ignore[misc]
    reg = Registry.from_url(redis.url, ttl_s=60.0)
    await reg.redis.flushdb()
    yield reg
    await reg.close()


def top(redis: RedisServer, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "top",
            "--redis-url",
            redis.url,
            "--interval",
            "0.2",
            "--once",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )


async def test_rates_are_counter_deltas_over_the_time_between_scrapes(
    registry: Registry, endpoints: dict[str, FakeWorkerMetrics]
) -> None:
    p, d, router = endpoints["prefill-a"], endpoints["decode-a"], endpoints["router"]
    await registry.heartbeat(
        record("prefill-a", "prefill", p.port, load=WorkerLoad(waiting=3, running=1, kv_usage=0.25))
    )
    await registry.heartbeat(
        record("decode-a", "decode", d.port, load=WorkerLoad(running=5, kv_usage=0.5))
    )
    fleet = Fleet(registry, routers=[f"127.0.0.1:{router.port}"])
    t0 = time.monotonic()
    first = await fleet.snapshot()
    t1 = time.monotonic()
    assert [r.prompt_tokens_per_s for r in first.rows] == [None, None]  # one scrape: no rate
    p.prompt.inc(4000)
    d.generation.inc(300)
    d.kv_bytes.inc(2e9)
    d.kv_failures.labels("recompute").inc(2)
    d.finished.labels("error").inc()
    d.finished.labels("stop").inc(9)  # not an error
    assert router.migrations is not None
    router.migrations.labels("stream_reset", "decode-a").inc(3)
    time.sleep(0.3)
    t2 = time.monotonic()
    second = await fleet.snapshot()
    t3 = time.monotonic()
    shortest, longest = t2 - t1, t3 - t0  # the scrapes were this far apart, at least/most
    rows: dict[str, Row] = {r.worker_id: r for r in second.rows}
    pre, dec = rows["prefill-a"], rows["decode-a"]
    assert [r.worker_id for r in second.rows] == ["prefill-a", "decode-a"]
    assert (pre.role, pre.host, pre.epoch, pre.queue, pre.running, pre.kv_usage) == (
        "prefill",
        "node-1",
        1,
        3,
        1,
        0.25,
    )
    assert pre.prompt_tokens_per_s is not None and dec.kv_gbytes_per_s is not None
    assert 4000 / longest <= pre.prompt_tokens_per_s <= 4000 / shortest
    assert 2.0 / longest <= dec.kv_gbytes_per_s <= 2.0 / shortest
    assert dec.generation_tokens_per_s is not None
    assert 300 / longest <= dec.generation_tokens_per_s <= 300 / shortest
    assert pre.generation_tokens_per_s == 0.0
    assert (dec.errors, pre.errors) == (3, 0)
    assert (dec.migrations, pre.migrations) == (3, 0)
    assert second.routers == {f"127.0.0.1:{router.port}": 3.0}


async def test_a_restarted_worker_has_no_rate_until_its_next_scrape(
    registry: Registry, endpoints: dict[str, FakeWorkerMetrics]
) -> None:
    p = endpoints["prefill-a"]
    rec = record("prefill-a", "prefill", p.port)
    await registry.heartbeat(rec)
    fleet = Fleet(registry)
    await fleet.snapshot()
    await registry.heartbeat(replace(rec, epoch=2, updated=time.time()))
    (row,) = (await fleet.snapshot()).rows
    assert row.epoch == 2 and row.prompt_tokens_per_s is None and row.metrics
    assert row.migrations is None  # no router was asked


async def test_once_json_and_table(
    registry: Registry, redis: RedisServer, endpoints: dict[str, FakeWorkerMetrics]
) -> None:
    await registry.heartbeat(
        record(
            "prefill-a",
            "prefill",
            endpoints["prefill-a"].port,
            load=WorkerLoad(waiting=2, running=1, kv_usage=0.125),
        )
    )
    # Registered with a metrics port nobody listens on (as a pod IP seen from outside).
    await registry.heartbeat(record("decode-a", "decode", free_port()))
    out = top(redis, "--json")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    rows = {r["worker_id"]: r for r in snap["workers"]}
    assert set(rows) == {"prefill-a", "decode-a"}
    assert (rows["prefill-a"]["queue"], rows["prefill-a"]["kv_usage"]) == (2, 0.125)
    assert rows["prefill-a"]["metrics"] is True
    assert rows["prefill-a"]["prompt_tokens_per_s"] == 0.0  # nothing moved between scrapes
    dead = rows["decode-a"]
    assert dead["metrics"] is False and dead["prompt_tokens_per_s"] is None
    assert dead["errors"] is None and dead["role"] == "decode"
    # --metrics points a worker at a reachable endpoint (a port-forward).
    forwarded = top(
        redis, "--json", "--metrics", f"decode-a=127.0.0.1:{endpoints['decode-a'].port}"
    )
    assert {r["worker_id"]: r["metrics"] for r in json.loads(forwarded.stdout)["workers"]} == {
        "prefill-a": True,
        "decode-a": True,
    }
    table = top(redis)
    assert table.returncode == 0, table.stderr
    for text in ("prefill-a", "decode-a", "12.5%", "1/8", "metrics not reachable"):
        assert text in table.stdout
    assert redis.password not in table.stdout  # the URL is shown without its password


def test_unreachable_redis_and_bad_flags_are_clear_errors() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.observability.top",
            "--redis-url",
            f"redis://127.0.0.1:{free_port()}/0",
            "--once",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1].startswith("error: cannot read the registry")
    assert "Traceback" not in out.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.observability.top",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--once",
            "--metrics",
            "nohost",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "WORKER=HOST:PORT" in bad.stderr


async def test_a_local_signed_stack_is_read_with_its_secret_and_router(
    redis: RedisServer, endpoints: dict[str, FakeWorkerMetrics], tmp_path: Path
) -> None:
    """What `pdserve up` leaves for top (its state file: Redis, secret, router metrics)
    is enough: records are checked under the stack's secret, with no warning."""
    secret = "a-cluster-secret-of-the-stack-" + "x" * 8
    signed = Registry.from_url(redis.url, ttl_s=60.0, signer=RecordSigner(secret.encode()))
    await signed.redis.flushdb()
    router = endpoints["router"]
    started = time.time_ns() - 725 * 10**9  # 12m05s ago
    p = endpoints["prefill-a"]
    try:
        await signed.heartbeat(
            replace(
                record("prefill-a", "prefill", 0, epoch=started),
                metrics_address=f"127.0.0.1:{p.port}",
            )
        )
    finally:
        await signed.close()
    assert router.migrations is not None
    router.migrations.labels("prefill_mid_stream", "prefill-a").inc(2)
    write_state_to = tmp_path / "up.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_CLUSTER_SECRET")}
    env.pop("PDSERVE_REDIS_URL", None)
    env["PDSERVE_STATE_FILE"] = str(write_state_to)
    state = {
        "redis_url": redis.url,
        "cluster_secret": secret,
        "tls_dir": "",
        "router_metrics": [f"127.0.0.1:{router.port}"],
    }
    write_state_to.write_text(json.dumps(state))
    command = [sys.executable, "-m", "services.cli", "top", "--once", "--interval", "0.2"]
    out = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "unsigned" not in out.stderr and "no cluster secret" not in out.stderr
    (row,) = json.loads(out.stdout)["workers"]
    assert row["metrics_address"] == f"127.0.0.1:{p.port}" and row["epoch"] == started
    assert row["migrations"] == 2 and 725 <= row["started_age_s"] < 800
    table = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert table.returncode == 0, table.stderr
    assert "unsigned" not in table.stdout + table.stderr and str(started) not in table.stdout
    assert f"127.0.0.1:{p.port}" in table.stdout and "12m0" in table.stdout
    # Another stack's Redis, without its secret: shown, and said to be unchecked.
    state["redis_url"] = "redis://127.0.0.1:1/0"
    write_state_to.write_text(json.dumps(state))
    other = subprocess.run(
        [*command, "--redis-url", redis.url], capture_output=True, text=True, timeout=60, env=env
    )
    assert other.returncode == 0, other.stderr
    assert "signatures" in other.stdout and "--cluster-secret-file" in other.stdout


# -- a real `pdserve up` stack -------------------------------------------------------------


@pytest.fixture(scope="module")
async def stack(session_dir: Path, model_path: Path) -> AsyncIterator[Up]:
    """A default `pdserve up --prefill 1 --decode 1` with its own state folder: its
    Prometheus targets file is at the default path, beside the state file."""
    workdir = session_dir / "top-up"
    workdir.mkdir(exist_ok=True)
    up = Up(workdir)
    async with up.serving() as running:
        yield running


def sd_file(up: Up) -> Path:
    return up.state_file.parent / "prometheus-targets.json"


def targets_of(up: Up) -> dict[str, tuple[str, dict[str, str]]]:
    """The targets file: worker id -> (address, labels)."""
    groups = json.loads(sd_file(up).read_text())
    out = {}
    for group in groups:
        (address,) = group["targets"]
        out[group["labels"]["worker_id"]] = (address, group["labels"])
    return out


async def wait_for_targets(
    up: Up, want: set[str], timeout: float = 30
) -> dict[str, tuple[str, dict[str, str]]]:
    deadline = time.monotonic() + timeout
    while True:
        got = targets_of(up) if sd_file(up).exists() else {}
        if set(got) == want:
            return got
        assert time.monotonic() < deadline, f"targets {sorted(got)}, expected {sorted(want)}"
        await asyncio.sleep(0.5)


def series(address: str) -> set[str]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def top_local(up: Up, *extra: str) -> subprocess.CompletedProcess[str]:
    """`pdserve top --once` as a user on the stack's machine runs it: no Redis URL, no
    secret in the environment (the stack signs its records), only its state file."""
    assert not any(k.startswith("PDSERVE_CLUSTER_SECRET") for k in up.env)
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "top", "--once", "--interval", "0.5", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=up.env,
    )


@pytest.mark.engine
async def test_the_targets_file_lists_every_worker_and_each_serves_vllm_series(stack: Up) -> None:
    records = {r.worker_id: r for r in await stack.records()}
    assert set(records) == {"prefill-0", "decode-0"}
    targets = await wait_for_targets(stack, {"router-0", "prefill-0", "decode-0"})
    for worker_id, r in records.items():
        address, labels = targets[worker_id]
        assert address == r.metrics_address == f"127.0.0.1:{r.metrics_port}"
        assert labels == {"role": r.role, "worker_id": worker_id, "model": r.model, "host": r.host}
        names = series(address)
        assert {"vllm:num_requests_running", "vllm:prompt_tokens_total"} <= names, worker_id
    address, labels = targets["router-0"]
    assert address == f"127.0.0.1:{stack.metrics_port}" and labels["role"] == "router"
    assert "pdserve_router_inflight" in series(address)
    assert os.stat(sd_file(stack)).st_mode & 0o777 == 0o644  # Prometheus may be another user


@pytest.mark.engine
async def test_top_reads_the_local_signed_stack_with_addresses_ages_and_migrations(
    stack: Up, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    # A stream whose decode worker is killed mid-answer moves to the prefill worker: one
    # migration off decode-0, which Ray then restarts on a new metrics port.
    (old,) = [r for r in await stack.records() if r.role == "decode"]
    got: list[int] = []
    async with PdserveClient(f"127.0.0.1:{stack.port}") as client:
        async for piece in client.stream(
            token_ids=prompt_of_length(tokenizer, 60, salt="top"),
            temperature=0.0,
            max_tokens=64,
            ignore_eos=True,
        ):
            if not got:
                os.kill(old.pid, signal.SIGKILL)
            got += piece.token_ids
    assert len(got) == 64
    records = await stack.wait_until(
        lambda rs: any(r.role == "decode" and r.epoch != old.epoch for r in rs),
        600,
        "the decode worker to come back",
    )
    new = {r.worker_id: r for r in records}
    # The targets file follows the restart to the new metrics address.
    targets = await wait_for_targets(stack, {"router-0", "prefill-0", "decode-0"})
    assert targets["decode-0"][0] == new["decode-0"].metrics_address
    assert "vllm:num_requests_running" in series(new["decode-0"].metrics_address)

    out = top_local(stack, "--json")
    assert out.returncode == 0, out.stderr
    assert "unsigned" not in out.stderr and "no cluster secret" not in out.stderr
    rows = {r["worker_id"]: r for r in json.loads(out.stdout)["workers"]}
    assert set(rows) == {"prefill-0", "decode-0"}
    for worker_id, r in new.items():
        row = rows[worker_id]
        assert row["metrics_address"] == r.metrics_address and row["metrics"] is True
        assert row["epoch"] == r.epoch  # the raw epoch stays in the JSON
        assert 0 <= row["started_age_s"] < 3600
    moved = rows["decode-0"]["migrations"]
    assert moved >= 1 and rows["prefill-0"]["migrations"] == 0

    table = top_local(stack)
    assert table.returncode == 0, table.stderr
    text = table.stdout + table.stderr
    assert "unsigned" not in text and "no cluster secret" not in text
    assert not re.search(r"\b\d{19}\b", table.stdout), table.stdout  # no raw epochs
    rows_shown = {}
    for line in table.stdout.splitlines():
        shown = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if shown[0] in new:
            rows_shown[shown[0]] = dict(zip(COLUMNS, shown, strict=True))
    assert set(rows_shown) == set(new), table.stdout
    for worker_id, r in new.items():
        shown = rows_shown[worker_id]
        assert shown["metrics"] == r.metrics_address
        assert re.fullmatch(r"\d+[smhd](\d\d[smh])? ago", shown["started"]), shown
    assert (rows_shown["decode-0"]["migrations"], rows_shown["prefill-0"]["migrations"]) == (
        str(moved),
        "0",
    )
    assert f"router 127.0.0.1:{stack.metrics_port}: {moved} migrations" in table.stdout


@pytest.mark.engine
async def test_the_targets_file_follows_a_scale_down_and_empties_on_down(stack: Up) -> None:
    out = stack.pdserve("scale", "--prefill", "0")
    assert out.returncode == 0, out.stderr
    await wait_for_targets(stack, {"router-0", "decode-0"}, timeout=120)
    out = stack.pdserve("down")
    assert out.returncode == 0, out.stderr
    assert stack.proc.wait(timeout=180) == 0
    assert json.loads(sd_file(stack).read_text()) == []  # Prometheus stops scraping it
