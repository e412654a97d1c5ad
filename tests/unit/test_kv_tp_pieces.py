"""KV between tensor-parallel layouts, the bookkeeping: each piece's transfer id, a
receiver's release of a transfer with its pieces, the load reports of several ranks
merged into one, and the scheduler half waiting for every rank's report. The scheduler
half is driven with the small stand-ins (named Fake*) of test_kv_scheduler_side."""

from __future__ import annotations

import pytest
import torch

from services.kv.fingerprint import LayoutFingerprint, PeerIdentity
from services.kv.metadata import LoadReports
from services.kv.params import LOAD_KEY, LoadReport, RecvParams, SendParams
from services.kv.scheduler_side import SchedulerSide
from services.kv.tp_layout import base_transfer_id, kv_pieces, piece_transfer_id
from services.kv.transport import ReceiveState, TransferSpec, TransportConfig
from services.kv.transport.staging import Refused, StagingTable
from services.worker.checks import check_id
from tests.unit.test_kv_scheduler_side import (
    BS,
    FakeBlocks,
    FakeBlockState,
    FakeConnectorOutput,
    FakeRequest,
    FakeSchedulerOutput,
)

FP = LayoutFingerprint("tiny", "float32", 16, 2, 4, 8, "cpu:test", "0.1.0")
ME = PeerIdentity("decode-x", 1, FP)
PEER = PeerIdentity("prefill-x", 2, FP)


def test_a_single_piece_keeps_the_transfer_id_and_pieces_get_their_own() -> None:
    (only,) = kv_pieces(1, 1, 4)
    assert piece_transfer_id("t-1", only, [only]) == "t-1"
    pieces = kv_pieces(2, 1, 4)
    ids = [piece_transfer_id("t-1", p, pieces) for p in pieces]
    assert ids == ["t-1#0-0", "t-1#1-0"]
    assert {base_transfer_id(i) for i in ids} == {"t-1"} and base_transfer_id("t-1") == "t-1"
    # Every pair up to 8x8 that 8 heads allow: ids unique, and never a transfer id a
    # caller could choose.
    for a in (1, 2, 4, 8):
        for b in (1, 2, 4, 8):
            pieces = kv_pieces(a, b, 8)
            ids = [piece_transfer_id("t", p, pieces) for p in pieces]
            assert len(set(ids)) == len(ids)
            if len(ids) > 1:
                for i in ids:
                    with pytest.raises(Exception, match="letters, digits"):
                        check_id("transfer_id", i)


def spec(tid: str, heads: tuple[int, int] = (0, 0)) -> TransferSpec:
    return TransferSpec(tid, 2, (1, 1, 16, 16), torch.float32, 16, ME.epoch, FP.digest(),
                        head_start=heads[0], head_stop=heads[1])


def test_releasing_a_transfer_releases_its_pieces_staged_or_still_to_come() -> None:
    table = StagingTable(ME, TransportConfig())
    for tid in ("t#0-0", "t#1-0", "other#0-0"):
        table.open(PEER, spec(tid, (0, 1)), "crc32c")
    table.discard("t")
    assert table.state("t#0-0") is table.state("t#1-0") is ReceiveState.UNKNOWN
    assert table.state("other#0-0") is ReceiveState.RECEIVING
    assert table.staged()[0] == 1
    with pytest.raises(Refused, match="released"):
        table.open(PEER, spec("t#2-0", (2, 3)), "crc32c")
    # A released piece does not release its transfer's other pieces' ids elsewhere.
    table.discard("other#0-0")
    table.open(PEER, spec("other#1-0", (1, 2)), "crc32c")


def test_reports_of_several_parts_merge_into_one() -> None:
    a = LoadReport("r", "t", ok=True, nbytes=10, first_byte_wall=5.0, last_byte_wall=6.0,
                   chunks=2, checksum_s=0.1, prompt_nbytes=20)
    b = LoadReport("r", "t", ok=False, nbytes=4, first_byte_wall=4.0, last_byte_wall=7.0,
                   chunks=1, checksum_s=0.2, error="checksum mismatch", prompt_nbytes=8)
    m = a.merged(b)
    assert (m.ok, m.nbytes, m.chunks, m.prompt_nbytes) == (False, 14, 3, 28)
    assert (m.first_byte_wall, m.last_byte_wall) == (4.0, 7.0)
    assert m.checksum_s == pytest.approx(0.3) and m.error == "checksum mismatch"
    # a part that received nothing has no first byte: it does not pull the start to 0
    assert a.merged(LoadReport("r", "t", ok=True)).first_byte_wall == 5.0


def test_the_scheduler_half_waits_for_every_rank_and_reports_them_as_one() -> None:
    side = SchedulerSide(BS, is_producer=False, ranks=2)
    req = FakeRequest("d1", 301, RecvParams("t1", 300, prefill_tp=2).to_params())
    assert side.get_num_new_matched_tokens(req, 0) == (300, True)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks([1, 2, 3]), 300)  # type: ignore[arg-type]
    (job,) = side.build_connector_meta(FakeSchedulerOutput({})).loads  # type: ignore[arg-type]
    assert job.prefill_tp == 2
    rank0 = LoadReport("d1", "t1", ok=True, nbytes=6)
    rank1 = LoadReport("d1", "t1", ok=True, nbytes=4)
    side.update_connector_output(  # type: ignore[arg-type]
        FakeConnectorOutput(kv_connector_worker_meta=LoadReports([rank0])))
    # one rank in: still loading (an abort now still cancels the other rank's wait)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    side.update_connector_output(  # type: ignore[arg-type]
        FakeConnectorOutput(kv_connector_worker_meta=LoadReports([rank1])))
    delay, params = side.request_finished(req, [1, 2, 3])  # type: ignore[arg-type]
    assert not delay and params == {LOAD_KEY: rank0.merged(rank1).to_dict()}
    assert params[LOAD_KEY]["nbytes"] == 10


def test_an_abort_between_two_ranks_reports_cancels_the_load() -> None:
    side = SchedulerSide(BS, is_producer=False, ranks=2)
    req = FakeRequest("d2", 201, RecvParams("t2", 200).to_params())
    side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks([1, 2]), 200)  # type: ignore[arg-type]
    side.build_connector_meta(FakeSchedulerOutput({}))  # type: ignore[arg-type]
    side.update_connector_output(FakeConnectorOutput(  # type: ignore[arg-type]
        kv_connector_worker_meta=LoadReports([LoadReport("d2", "t2", ok=True)])))
    assert side.request_finished(req, [1, 2]) == (False, None)  # type: ignore[arg-type]
    meta = side.build_connector_meta(FakeSchedulerOutput({}))  # type: ignore[arg-type]
    assert meta.cancelled_loads == ["d2"]


def test_the_producer_job_names_every_decode_rank() -> None:
    side = SchedulerSide(BS, is_producer=True, ranks=2)
    params = SendParams("t1", "h:1", "grpc", 7, "abc", kv_addresses=("h:1", "h:2"))
    req = FakeRequest("p1", 100, params.to_params())
    side.update_state_after_alloc(req, FakeBlocks([4]), 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta(  # type: ignore[arg-type]
        FakeSchedulerOutput({"p1": 100}, FakeBlockState({"p1": [4]})))
    (job,) = meta.saves
    assert job.kv_addresses == ["h:1", "h:2"]
    # a request from before the field: one rank, at kv_address
    old = {"pdserve": {k: v for k, v in params.to_params()["pdserve"].items()
                       if k != "kv_addresses"}}
    assert SendParams.of(old).rank_addresses == ["h:1"]  # type: ignore[union-attr]


def test_a_decode_record_lists_a_kv_receiver_per_rank() -> None:
    import json

    from pdserve.v1 import worker_pb2 as wpb
    from services.registry.records import BadRecord, WorkerRecord
    from services.router.view import record_of

    info = wpb.WorkerInfo(worker_id="d", role=wpb.WORKER_ROLE_DECODE, epoch=1,
                          fingerprint_digest=FP.digest(),
                          fingerprint_json=json.dumps(FP.to_dict()), kv_address="h:1",
                          kv_addresses=["h:1", "h:2"], kv_transport="grpc", tp=2)
    record = record_of(info, "h:9")
    assert (record.tp, record.kv_heads, record.kv_addresses) == (2, 2, ("h:1", "h:2"))
    assert WorkerRecord.from_json(json.dumps(record.to_dict())) == record
    older = record.to_dict()
    del older["kv_addresses"]  # a writer from before the field: one rank
    assert WorkerRecord.from_dict(older).kv_addresses == ()
    with pytest.raises(BadRecord, match="kv_addresses"):
        WorkerRecord.from_dict({**record.to_dict(), "kv_addresses": ["nowhere"]})
    # an older worker's GetWorkerInfo has no tp: it ran at TP 1, its heads all its own
    info.ClearField("tp")
    del info.kv_addresses[:]
    assert (record_of(info, "h:9").tp, record_of(info, "h:9").kv_heads) == (1, 4)


def test_a_prefill_worker_checks_every_decode_rank_address() -> None:
    from pdserve.v1 import worker_pb2 as wpb
    from services.errors import InvalidRequest
    from services.worker.checks import check_target

    def target(*addresses: str) -> wpb.KVTarget:
        return wpb.KVTarget(worker_id="d", epoch=1, kv_address="h:1", kv_transport="grpc",
                            fingerprint_digest="x", kv_addresses=list(addresses))

    check_target(target(), "x", "")
    check_target(target("h:1", "h:2"), "x", "")
    with pytest.raises(InvalidRequest, match=r"kv_addresses\[1\]"):
        check_target(target("h:1", "h:2:3"), "x", "")
    with pytest.raises(InvalidRequest, match="first rank"):
        check_target(target("h:2", "h:1"), "x", "")
