"""Worker records and signed documents: pure parsing and HMAC logic."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import pytest

from services.launcher.desired import Desired
from services.registry.records import BadRecord, WorkerLoad, WorkerRecord, layout_differences
from services.registry.signing import RecordSigner, record_signer

SECRET = b"s" * 32


def record(**changes: object) -> dict[str, object]:
    r = WorkerRecord(worker_id="decode-0", role="decode", address="127.0.0.1:5000",
                     host="h", epoch=7, fingerprint="f", kv_address="127.0.0.1:5001",
                     kv_transport="grpc", load=WorkerLoad(running=2, kv_usage=0.5),
                     updated=time.time())
    return {**asdict(r), **changes}


def test_unknown_fields_are_ignored_and_missing_optional_ones_defaulted() -> None:
    d = record(future_field={"x": 1})
    for name in ("capacity", "model", "pid", "kv_address", "kv_transport"):
        del d[name]
    d["load"] = {"running": 3, "new_load_figure": 1.0}
    r = WorkerRecord.from_json(json.dumps(d))
    assert (r.worker_id, r.capacity, r.model, r.pid, r.load.running, r.load.waiting) == (
        "decode-0", 64, "", 0, 3, 0)


def test_the_kv_layout_round_trips_and_an_older_record_reads_as_tp_1() -> None:
    r = WorkerRecord.from_json(json.dumps(record(tp=2, kv_heads=4, block_size=16,
                                                 dtype="bfloat16")))
    assert (r.tp, r.kv_heads, r.block_size, r.dtype) == (2, 4, 16, "bfloat16")
    assert WorkerRecord.from_json(json.dumps(r.to_dict())) == r
    older = record()
    for name in ("tp", "kv_heads", "block_size"):
        del older[name]
    r = WorkerRecord.from_dict(older)
    assert (r.tp, r.kv_heads, r.block_size) == (1, 0, 0)  # 0: not reported


def test_the_kv_events_flag_round_trips_and_an_older_record_has_none() -> None:
    r = WorkerRecord.from_dict(record(kv_events=True))
    assert WorkerRecord.from_json(json.dumps(r.to_dict())).kv_events is True
    older = record()
    del older["kv_events"]
    older["kv_events_address"] = "127.0.0.1:5557"  # a writer of the ZeroMQ events port
    assert WorkerRecord.from_dict(older).kv_events is False  # approximate index for it


def test_layout_differences_say_which_part_of_the_layout_differs() -> None:
    def layout(fingerprint: str, **parts: object) -> WorkerRecord:
        return WorkerRecord.from_dict(record(fingerprint=fingerprint, model="m",
                                             dtype="bfloat16", **parts))

    a = layout("aa", tp=1, kv_heads=8, block_size=16)
    assert layout_differences(a, a) == []
    assert layout_differences(a, layout("bb", tp=2, kv_heads=4, block_size=32)) == [
        "tensor-parallel size 1 != 2", "KV heads per rank 8 != 4", "KV block size 16 != 32"]
    # An older writer's unreported parts are not compared; the fingerprints still say why.
    (why,) = layout_differences(a, layout("bb"))
    assert why.startswith("KV layout fingerprint aa != bb")


@pytest.mark.parametrize(("text", "reason"), [
    ("{not json", "json"),
    ("[1, 2]", "schema"),
    ('"a string"', "json"),
    (b"\xff\xfe", "json"),
])
def test_what_is_not_a_json_object_is_refused(text: str | bytes, reason: str) -> None:
    with pytest.raises(BadRecord) as e:
        WorkerRecord.from_json(text)
    assert e.value.reason == reason


@pytest.mark.parametrize("changes", [
    {"epoch": "7"}, {"epoch": True}, {"capacity": 1.5}, {"address": 5000},
    {"role": "janitor"}, {"kv_transport": "carrier-pigeon"}, {"address": "no-port"},
    {"address": "host:99999"}, {"worker_id": ""}, {"capacity": 0}, {"load": [1]},
    {"load": {"running": "many"}}, {"updated": "yesterday"}, {"tp": 0}, {"tp": "2"},
    {"kv_heads": -1}, {"block_size": -16}, {"block_size": 16.0},
    {"kv_events": 1}, {"kv_events": "true"}, {"capacity": True}, {"updated": False},
])
def test_wrong_types_and_values_are_schema_errors(changes: dict[str, object]) -> None:
    with pytest.raises(BadRecord) as e:
        WorkerRecord.from_dict(record(**changes))
    assert e.value.reason == "schema"


def test_a_required_field_missing_is_a_schema_error() -> None:
    d = record()
    del d["fingerprint"]
    with pytest.raises(BadRecord, match="fingerprint"):
        WorkerRecord.from_dict(d)


def test_an_integer_where_a_float_goes_is_fine() -> None:
    assert WorkerRecord.from_dict(record(updated=12)).updated == 12.0


def test_sealed_records_open_with_the_secret_only() -> None:
    signer = RecordSigner(SECRET)
    text = signer.seal("worker", record())
    assert WorkerRecord.from_dict(signer.open("worker", text)).epoch == 7
    for other in (RecordSigner(b"t" * 32),):
        with pytest.raises(BadRecord) as e:
            other.open("worker", text)
        assert e.value.reason == "signature"


def test_any_change_breaks_the_signature() -> None:
    signer = RecordSigner(SECRET)
    d = json.loads(signer.seal("worker", record()))
    d["address"] = "10.0.0.66:5000"
    with pytest.raises(BadRecord, match="signature"):
        signer.open("worker", json.dumps(d))
    del d["sig"]
    with pytest.raises(BadRecord, match="unsigned"):
        signer.open("worker", json.dumps(d))


def test_a_signature_of_one_kind_is_not_valid_for_another() -> None:
    signer = RecordSigner(SECRET)
    text = signer.seal("desired", {"prefill": 1, "decode": 1})
    with pytest.raises(BadRecord, match="signature"):
        signer.open("worker", text)


def test_key_order_and_spacing_do_not_matter() -> None:
    signer = RecordSigner(SECRET)
    d = json.loads(signer.seal("worker", record()))
    shuffled = json.dumps(dict(reversed(list(d.items()))), indent=2)
    assert signer.open("worker", shuffled)["worker_id"] == "decode-0"


def test_unsigned_mode_accepts_any_record() -> None:
    text = RecordSigner(SECRET).seal("worker", record())
    assert RecordSigner(None).open("worker", text)["epoch"] == 7
    assert "sig" not in RecordSigner(None).seal("worker", record())


def test_no_secret_is_refused_unless_explicitly_allowed(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    with pytest.raises(ValueError, match="allow-unsigned-records"):
        record_signer("", "", allow_unsigned=False)
    assert not record_signer("", "", allow_unsigned=True).signs
    assert "NOT signed" in caplog.text
    with pytest.raises(ValueError, match="16 bytes"):
        record_signer("short")


def test_secret_from_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "secret"
    path.write_text("x" * 40 + "\n")
    assert record_signer(secret_file=str(path)).signs


def test_desired_state_versions_and_validation() -> None:
    d = Desired(1, 1, stack="a").updated()
    later = d.updated(prefill=0)
    assert later.version > d.version and later.prefill == 0 and later.stack == "a"
    assert Desired.from_dict(asdict(later)) == later
    for bad in ({"prefill": -1, "decode": 1}, {"prefill": 1, "decode": 0}, {"decode": 1},
                {"prefill": "x", "decode": 1}):
        with pytest.raises(BadRecord):
            Desired.from_dict(bad)
