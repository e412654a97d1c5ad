"""Shipping only the blocks the decode worker lacks: the block arithmetic, and the
scheduler half's decisions on both sides. Pure bookkeeping; vLLM's request, block and
scheduler-output objects are the small stand-ins (Fake*) of test_kv_scheduler_side."""

from __future__ import annotations

import pytest
import torch

from services.kv.params import LOAD_KEY, LoadReport, RecvParams, SendParams
from services.kv.reuse import REUSED_PREFIX_GONE, LoadPlan, first_block, plan_load, shipped_blocks
from services.kv.scheduler_side import SchedulerSide
from services.kv.transport import TransferSpec, frames
from tests.unit.test_kv_scheduler_side import (
    BS,
    FakeBlocks,
    FakeBlockState,
    FakeRequest,
    FakeSchedulerOutput,
)


@pytest.mark.parametrize(("reuse", "n", "first"), [
    (0, 300, 0),  # no hint: every block
    (128, 300, 1),
    (256, 300, 2),  # the last, partial block still travels
    (256, 256, 1),  # the whole prompt cached: its last block travels anyway
    (128, 129, 1),
    (128, 128, 0),
])
def test_the_transfer_starts_after_the_reused_whole_blocks(reuse: int, n: int,
                                                           first: int) -> None:
    assert first_block(reuse, n, BS) == first
    shipped = shipped_blocks(n, BS, first)
    assert len(shipped) >= 1 and shipped.stop == -(-n // BS)


@pytest.mark.parametrize(("reuse", "n", "words"), [
    (100, 300, "whole number of KV blocks"),
    (-128, 300, "whole number of KV blocks"),
    (384, 300, "more than the prompt's 300 tokens"),
])
def test_a_hint_that_is_not_whole_blocks_of_the_prompt_is_refused(reuse: int, n: int,
                                                                  words: str) -> None:
    with pytest.raises(ValueError, match=words):
        first_block(reuse, n, BS)


@pytest.mark.parametrize(("num_computed", "remote", "first", "plan"), [
    (0, 300, 0, LoadPlan(300, 0)),  # nothing held, nothing skipped: today's load
    (256, 300, 2, LoadPlan(44, 2)),  # holds exactly what was skipped
    (256, 300, 1, LoadPlan(44, 2)),  # holds more than the router believed: loads less
    (128, 300, 2, LoadPlan(0, 0, REUSED_PREFIX_GONE)),  # evicted meanwhile: a gap
    (0, 300, 1, LoadPlan(0, 0, REUSED_PREFIX_GONE)),
    (256, 256, 1, LoadPlan(0, 0)),  # the whole prompt here: nothing to load
])
def test_the_decode_side_loads_from_the_end_of_its_own_prefix(
        num_computed: int, remote: int, first: int, plan: LoadPlan) -> None:
    got = plan_load(num_computed, remote, first, BS)
    assert got == plan
    assert got.drop_transfer == (plan.claim == 0)


def test_the_producer_ships_the_blocks_after_the_reused_prefix() -> None:
    side = SchedulerSide(BS, is_producer=True)
    params = SendParams("t1", "127.0.0.1:1", "grpc", 7, "abc", first_block=2).to_params()
    req = FakeRequest("p1", 300, params)
    side.update_state_after_alloc(req, FakeBlocks([4, 9, 2]), 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta(  # type: ignore[arg-type]
        FakeSchedulerOutput({"p1": 300}, FakeBlockState({"p1": [4, 9, 2]})))
    (job,) = meta.saves
    assert (job.block_ids, job.first_block, job.num_tokens) == ([2], 2, 300)


def test_a_producer_given_a_first_block_past_the_prompt_ships_every_block() -> None:
    # The decode side expects block 5 and refuses what arrives: loud, and recomputed.
    side = SchedulerSide(BS, is_producer=True)
    params = SendParams("t1", "127.0.0.1:1", "grpc", 7, "abc", first_block=5).to_params()
    req = FakeRequest("p1", 300, params)
    side.update_state_after_alloc(req, FakeBlocks([4, 9, 2]), 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta(  # type: ignore[arg-type]
        FakeSchedulerOutput({"p1": 300}, FakeBlockState({"p1": [4, 9, 2]})))
    (job,) = meta.saves
    assert (job.block_ids, job.first_block) == ([4, 9, 2], 0)


def test_the_consumer_fills_only_the_blocks_after_its_own_prefix() -> None:
    side = SchedulerSide(BS, is_producer=False)
    # prompt + token 1; the transfer starts at block 2 and the engine holds 2 blocks
    req = FakeRequest("d1", 301, RecvParams("t1", 300, first_block=2).to_params())
    assert side.get_num_new_matched_tokens(req, 256) == (44, True)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks([10, 11, 12]), 44)  # type: ignore[arg-type]
    meta = side.build_connector_meta(FakeSchedulerOutput({}))  # type: ignore[arg-type]
    (job,) = meta.loads
    assert job.local_block_ids == [12] and job.remote_first_block == 2
    assert (job.transfer_first_block, job.reused_tokens) == (2, 256)
    assert meta.dropped_transfers == []


def test_a_consumer_that_lost_the_reused_prefix_computes_the_prompt_itself() -> None:
    side = SchedulerSide(BS, is_producer=False)
    req = FakeRequest("d2", 301, RecvParams("t2", 300, first_block=2).to_params())
    # only one of the two skipped blocks is still cached: claim nothing, vLLM recomputes
    assert side.get_num_new_matched_tokens(req, 128) == (0, False)  # type: ignore[arg-type]
    # a second look (no room in the first step) decides the same
    assert side.get_num_new_matched_tokens(req, 256) == (0, False)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks([10, 11, 12]), 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta(FakeSchedulerOutput({}))  # type: ignore[arg-type]
    assert meta.loads == [] and meta.dropped_transfers == ["t2"]
    assert side.build_connector_meta(  # type: ignore[arg-type]
        FakeSchedulerOutput({})).dropped_transfers == []
    delay, params = side.request_finished(req, [10, 11, 12])  # type: ignore[arg-type]
    report = LoadReport.of_output(params)
    assert not delay and report is not None
    assert (report.ok, report.recomputed, report.reused_tokens) == (False, REUSED_PREFIX_GONE,
                                                                    128)


def test_a_consumer_holding_the_whole_prompt_drops_the_transfer() -> None:
    side = SchedulerSide(BS, is_producer=False)
    req = FakeRequest("d3", 257, RecvParams("t3", 256, first_block=1).to_params())
    assert side.get_num_new_matched_tokens(req, 256) == (0, False)  # type: ignore[arg-type]
    meta = side.build_connector_meta(FakeSchedulerOutput({}))  # type: ignore[arg-type]
    assert meta.dropped_transfers == ["t3"]
    _, params = side.request_finished(req, [1, 2, 3])  # type: ignore[arg-type]
    assert params is not None and params[LOAD_KEY]["ok"] is True
    assert params[LOAD_KEY]["reused_tokens"] == 256 and params[LOAD_KEY]["nbytes"] == 0


def test_the_first_block_crosses_every_wire_header() -> None:
    spec = TransferSpec("t", 2, (3, 4, 16, 8), torch.float32, 300, 1, "fp", first_block=2)
    assert frames.spec_from_dict(frames.spec_to_dict(spec)) == spec
    older = frames.spec_to_dict(spec)
    del older["first_block"]  # a header that names none: every block
    assert frames.spec_from_dict(older).first_block == 0
    with pytest.raises(frames.FrameError, match="first_block"):
        frames.spec_from_dict({**older, "first_block": -1})
    with pytest.raises(frames.FrameError, match="first_block"):
        frames.spec_from_dict({**older, "first_block": "2"})


def test_the_params_carry_the_first_block_and_the_report_its_figures() -> None:
    recv = RecvParams("t", 300, first_block=2)
    assert RecvParams.of(recv.to_params()) == recv
    send = SendParams("t", "a:1", "grpc", 1, "fp", first_block=2)
    assert SendParams.of(send.to_params()) == send
    report = LoadReport("r", "t", ok=True, nbytes=10, reused_tokens=256, prompt_nbytes=30)
    assert LoadReport.of_output(report.to_output()) == report
