"""The KV leg's contracts, one per hop: `KVSettings` (worker service -> connector, in
`kv_connector_extra_config`), `SendParams` / `RecvParams` (service -> connector, in
`kv_transfer_params`), `LoadReport` (connector -> decode service, on the final output),
and the decode span that reads the report. Each is a round trip through its dict form,
and each refuses a key it does not know, naming it."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.kv.params import LOAD_KEY, LoadReport, RecvParams, SendParams
from services.kv.settings import TRANSPORT_DEFAULTS, KVSettings
from services.messages import Timings
from services.observability.request_spans import (
    DecodeTally,
    KVLoad,
    decode_span,
    finish_decode,
)
from services.security.tls import TLSFiles


def settings(**changes: Any) -> KVSettings:
    return KVSettings.from_dict({"worker_id": "decode-0", "epoch": 7, **changes})


# -- KVSettings ---------------------------------------------------------------------------
def test_settings_round_trip_through_their_dict() -> None:
    s = settings(kv_transport="torch", checksum="xxh3", max_staged_bytes=1 << 20, shm=False,
                 tls_ca_file="ca.crt", tls_cert_file="d.crt", tls_key_file="d.key")
    assert KVSettings.from_dict(s.to_dict()) == s
    assert s.to_dict()["max_staged_bytes"] == 1 << 20 and s.to_dict()["epoch"] == 7


def test_settings_refuse_an_unknown_key_by_name() -> None:
    with pytest.raises(ValueError, match=r"KVSettings: unknown key 'chekcsum' \(known: .*"
                                         r"checksum"):
        settings(chekcsum="xxh3")


def test_settings_refuse_a_missing_key_and_a_wrong_type() -> None:
    with pytest.raises(ValueError, match="KVSettings: missing key 'epoch'"):
        KVSettings.from_dict({"worker_id": "w"})
    with pytest.raises(ValueError, match="KVSettings: key 'shm' must be bool, got str"):
        settings(shm="false")
    with pytest.raises(ValueError, match="KVSettings: key 'kv_port' must be int"):
        settings(kv_port=True)
    with pytest.raises(ValueError, match="kv_transport 'tcp'"):
        settings(kv_transport="tcp")
    with pytest.raises(ValueError, match="unknown checksum"):
        settings(checksum="md5")
    assert settings(lease_s=5).lease_s == 5.0  # an int where a float goes is one


def test_the_transports_config_is_derived_from_the_settings() -> None:
    s = settings(chunk_bytes=4096, lease_s=3.0, max_streams=4, max_staged_bytes=1 << 20,
                 checksum="crc32", header_timeout_s=2.0, tls_ca_file="a", tls_cert_file="b",
                 tls_key_file="c")
    t = s.transport_config("cuda:1")
    assert (t.chunk_bytes, t.lease_s, t.max_streams, t.max_staged_bytes, t.checksum) == (
        4096, 3.0, 4, 1 << 20, "crc32")
    assert t.header_timeout_s == 2.0 and t.tls and t.ipc_device == "cuda:1"
    # CUDA IPC only with shm, and only when on
    assert settings(cuda_ipc=False).transport_config("cuda:1").ipc_device == ""
    assert settings(shm=False).transport_config("cuda:1").ipc_device == ""
    # nixl's registered arena is on the worker's GPU whatever shm says; on a CPU, in DRAM
    assert settings(shm=False).transport_config("cuda:1").gpu == "cuda:1"
    assert settings().transport_config().gpu == ""
    assert not settings().transport_config().tls


def test_the_worker_builds_the_settings_vllm_carries() -> None:
    from services.worker.config import WorkerConfig
    from services.worker.worker import WorkerIdentity, kv_settings, kv_transfer_config

    identity = WorkerIdentity("decode-0", "decode", 11)
    config = WorkerConfig.model_validate({"kv_checksum": "xxh3", "kv_lease_s": 4.0,
                                          "allow_fault_injection": True})
    tls = TLSFiles.of("/certs/ca.crt", "/certs/decode.crt", "/certs/decode.key")
    s = kv_settings(identity, config, "/tmp/port", 1 << 20, tls)
    assert (s.worker_id, s.epoch, s.port_file, s.checksum, s.lease_s) == (
        "decode-0", 11, "/tmp/port", "xxh3", 4.0)
    assert s.allow_faults and s.max_staged_bytes == 1 << 20
    assert (s.tls_ca_file, s.tls_cert_file, s.tls_key_file) == (
        "/certs/ca.crt", "/certs/decode.crt", "/certs/decode.key")
    plain = kv_settings(identity, config, "", 0, None)
    assert plain.tls_ca_file == "" and plain.max_staged_bytes == TRANSPORT_DEFAULTS.max_staged_bytes
    # kv_staging_gib unset: the staging cap is the engine's KV cache size
    vllm_config = kv_transfer_config(identity, config, "/tmp/port", 1 << 20, tls)
    assert vllm_config.kv_role == "kv_consumer"
    assert KVSettings.from_dict(vllm_config.kv_connector_extra_config) == s


# -- kv_transfer_params -------------------------------------------------------------------
def test_send_and_recv_params_round_trip_through_kv_transfer_params() -> None:
    send = SendParams("t-1", "10.0.0.2:5000", "torch", 3, "abc", "corrupt_chunk", True)
    params = send.to_params()
    assert params["pdserve"]["role"] == "send"
    assert SendParams.of(params) == send and SendParams.from_dict(send.to_dict()) == send
    assert RecvParams.of(params) is None  # the other role's entry is not ours
    recv = RecvParams("t-1", 300)
    assert RecvParams.of(recv.to_params()) == recv and SendParams.of(recv.to_params()) is None
    assert SendParams.of(None) is None and RecvParams.of({"other": {}}) is None


def test_params_refuse_unknown_and_missing_keys() -> None:
    entry = {"role": "recv", "transfer_id": "t", "num_tokens": 3, "num_tokns": 4}
    with pytest.raises(ValueError, match="RecvParams: unknown key 'num_tokns'"):
        RecvParams.of({"pdserve": entry})
    with pytest.raises(ValueError, match="SendParams: missing key 'decode_epoch'"):
        SendParams.from_dict({"transfer_id": "t", "kv_address": "a:1", "kv_transport": "grpc",
                              "decode_fingerprint": "d"})
    with pytest.raises(ValueError, match="RecvParams: key 'num_tokens' must be int"):
        RecvParams.from_dict({"transfer_id": "t", "num_tokens": "3"})


# -- the load report ------------------------------------------------------------------------
REPORT = LoadReport("req-1", "t-1", ok=True, nbytes=3 << 20, first_byte_wall=1000.10,
                    last_byte_wall=1000.16, chunks=30, checksum_s=0.004)


def test_the_load_report_round_trips_through_the_final_output() -> None:
    out = REPORT.to_output()
    assert set(out) == {LOAD_KEY} and out[LOAD_KEY]["chunks"] == 30
    assert LoadReport.of_output(out) == REPORT
    assert LoadReport.of_output(None) is None and LoadReport.of_output({}) is None
    failed = LoadReport("req-2", "t-2", ok=False, error="no complete KV after 30 s")
    assert LoadReport.of_output(failed.to_output()) == failed


def test_the_load_report_refuses_unknown_keys() -> None:
    entry = {**REPORT.to_dict(), "bytes": 3}
    with pytest.raises(ValueError, match="LoadReport: unknown key 'bytes'"):
        LoadReport.of_output({LOAD_KEY: entry})
    with pytest.raises(ValueError, match="not a mapping"):
        LoadReport.of_output({LOAD_KEY: [1, 2]})


def test_the_decode_span_reads_the_typed_report(spans: InMemorySpanExporter) -> None:
    span = decode_span("r", 100, "decode-a", 5, None, local_prefill=False)
    timings = Timings(decode_queue_s=0.2, decode_s=0.5, kv_transfer_hidden_s=0.04)
    tally = DecodeTally(received_wall=1000.0, first_step_wall=1000.2, steps=4, tokens=4,
                        finish_reason="length")
    finish_decode(span, None, tally, timings, KVLoad(REPORT, "grpc", "prefill-a", "decode-a"))
    span.end()
    kv = next(s for s in spans.get_finished_spans() if s.name == "pdserve.kv_transfer")
    a = dict(kv.attributes or {})
    assert a["pdserve.kv.transfer_id"] == "t-1" and a["pdserve.kv.bytes"] == 3 << 20
    assert a["pdserve.kv.chunks"] == 30 and a["pdserve.kv.checksum_s"] == 0.004
    assert a["pdserve.kv.staged_s"] == pytest.approx(0.04)
    d = next(s for s in spans.get_finished_spans() if s.name == "pdserve.decode")
    assert dict(d.attributes or {})["pdserve.decode.kv_wait_s"] == pytest.approx(0.16)
