"""What `pdserve top` prints and what the Prometheus targets file holds, as pure
functions of worker records: ages, epochs, metrics addresses, target groups, the
secret and routers top picks for a local stack."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from services.observability.discovery import (
    RouterTarget,
    TargetsFile,
    sd_file_path,
    target_groups,
    write_atomically,
)
from services.observability.fleet import Row, started_age_s
from services.observability.top import COLUMNS, UNSIGNED_NOTE, age, cells, source
from services.registry.local_stack import LocalStack, write_state
from services.registry.records import BadRecord, WorkerRecord
from services.server.settings import ServerSettings

EPOCH = 1_764_950_400_123_456_789  # time.time_ns() of a worker's start


def record(worker_id: str, role: str = "decode", **extra: object) -> WorkerRecord:
    fields: dict[str, object] = {
        "worker_id": worker_id,
        "role": role,
        "address": "10.0.0.5:41000",
        "host": "node-1",
        "epoch": EPOCH,
        "fingerprint": "f" * 16,
        "model": "SmolLM2",
        **extra,
    }
    return WorkerRecord.from_dict(fields)


def row(**extra: object) -> Row:
    fields: dict[str, object] = dict(
        worker_id="decode-0",
        role="decode",
        host="node-1",
        address="127.0.0.1:4100",
        epoch=EPOCH,
        started_age_s=725.0,
        metrics_address="127.0.0.1:39001",
        queue=0,
        running=1,
        capacity=8,
        kv_usage=0.5,
        heartbeat_age_s=0.25,
        metrics=True,
    )
    fields.update(extra)
    return Row(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.4, "0s"),
        (42.9, "42s"),
        (60, "1m00s"),
        (725, "12m05s"),
        (3 * 3600 + 240, "3h04m"),
        (2 * 86400 + 3 * 3600 + 59, "2d03h"),
    ],
)
def test_ages_read_as_durations(seconds: float, text: str) -> None:
    assert age(seconds) == text


def test_an_epoch_is_shown_as_the_age_of_the_workers_start() -> None:
    assert started_age_s(EPOCH, EPOCH / 1e9 + 90.5) == pytest.approx(90.5)
    assert started_age_s(3, time.time()) is None  # a counter, not a start time
    text = cells(row())
    assert "12m05s ago" in text and str(EPOCH) not in text
    assert "127.0.0.1:39001" in text
    assert str(3) in cells(row(epoch=3, started_age_s=None))  # no time: shown raw
    assert cells(row(metrics_address=""))[COLUMNS.index("metrics")] == "-"
    assert cells(row(migrations=2))[-2] == "2" and cells(row())[-2] == "-"


def test_each_worker_shows_its_tensor_parallel_size() -> None:
    assert len(cells(row())) == len(COLUMNS)
    assert cells(row(tp=4))[COLUMNS.index("TP")] == "4"
    assert cells(row())[COLUMNS.index("TP")] == "1"  # an older record: TP 1


def test_the_metrics_address_is_the_registered_one_else_the_grpc_host_and_port() -> None:
    assert record("d", metrics_port=9400).metrics_target == "10.0.0.5:9400"
    assert (
        record("d", metrics_port=9400, metrics_address="10.0.1.7:9400").metrics_target
        == "10.0.1.7:9400"
    )
    assert record("d").metrics_target == ""
    with pytest.raises(BadRecord):
        record("d", metrics_address="no-port")


def test_target_groups_name_every_endpoint_with_its_role_id_and_model() -> None:
    workers = [
        record("decode-0", metrics_address="127.0.0.1:39002"),
        record("prefill-0", "prefill", metrics_address="127.0.0.1:39001"),
        record("decode-1"),
    ]  # no metrics port: no target
    router = RouterTarget.of("router-0", ServerSettings(host="0.0.0.0", metrics_port=9400))
    assert router is not None
    assert target_groups(workers, [router]) == [
        {
            "targets": ["127.0.0.1:9400"],
            "labels": {"role": "router", "worker_id": "router-0", "model": "SmolLM2"},
        },
        {
            "targets": ["127.0.0.1:39001"],
            "labels": {
                "role": "prefill",
                "worker_id": "prefill-0",
                "model": "SmolLM2",
                "host": "node-1",
            },
        },
        {
            "targets": ["127.0.0.1:39002"],
            "labels": {
                "role": "decode",
                "worker_id": "decode-0",
                "model": "SmolLM2",
                "host": "node-1",
            },
        },
    ]
    assert RouterTarget.of("router-1", ServerSettings(metrics_port=-1)) is None
    assert RouterTarget.of("router-0", ServerSettings(metrics_port=0)) is None


def test_the_targets_file_is_replaced_whole_and_only_on_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_STATE_FILE", str(tmp_path / "stack" / "up.json"))
    assert sd_file_path() == tmp_path / "stack" / "prometheus-targets.json"
    assert sd_file_path("~/sd.json") == Path.home() / "sd.json"
    path = tmp_path / "sd" / "pdserve.json"
    write_atomically(path, "[]\n")
    assert path.read_text() == "[]\n" and list(path.parent.iterdir()) == [path]
    targets = TargetsFile(path, registry=None)  # type: ignore[arg-type]
    groups = target_groups([record("decode-0", metrics_address="127.0.0.1:1")])
    assert targets.write(groups) is True
    assert json.loads(path.read_text()) == groups
    assert targets.write(groups) is False  # unchanged: not rewritten
    assert list(path.parent.iterdir()) == [path]  # no temporary file left


def args(**given: object) -> argparse.Namespace:
    values: dict[str, object] = {"redis_url": "", "cluster_secret_file": "", "router_metrics": []}
    values.update(given)
    return argparse.Namespace(**values)


def test_top_reads_a_local_stack_with_its_secret_and_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("PDSERVE_REDIS_URL", "PDSERVE_CLUSTER_SECRET", "PDSERVE_CLUSTER_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PDSERVE_STATE_FILE", str(tmp_path / "up.json"))
    secret = "s" * 32
    write_state(LocalStack("redis://:pw@127.0.0.1:6400/0", secret, "", ("127.0.0.1:9400",)))
    local = source(args())
    assert local.redis_url == "redis://:pw@127.0.0.1:6400/0" and local.signer.signs
    assert local.routers == ["127.0.0.1:9400"] and local.note == ""
    same = source(args(redis_url="redis://:pw@127.0.0.1:6400/0"))
    assert same.signer.signs  # the local stack's Redis, named: its secret still applies
    other = source(args(redis_url="redis://10.0.0.9:6379/0"))
    assert not other.signer.signs and other.note == UNSIGNED_NOTE and other.routers == []
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret)
    given = source(
        args(
            redis_url="redis://10.0.0.9:6379/0",
            cluster_secret_file=str(secret_file),
            router_metrics=["h:1"],
        )
    )
    assert given.signer.signs and given.routers == ["h:1"]
