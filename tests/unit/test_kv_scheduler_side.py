"""The connector's scheduler half: which blocks to ship or fill, and when blocks may be
freed. Pure bookkeeping, driven here with small stand-ins (named Fake*) for vLLM's
request, block and scheduler-output objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.kv.metadata import LoadReports
from services.kv.params import LOAD_KEY, LoadReport, RecvParams, SendParams
from services.kv.scheduler_side import SchedulerSide

BS = 128


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int = 0


@dataclass
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class FakeBlockState:
    tables: dict[str, list[int]]

    def get_block_ids(self, rid: str) -> tuple[list[int], ...] | None:
        return (self.tables[rid],) if rid in self.tables else None


@dataclass
class FakeSchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    kv_connector_block_state: FakeBlockState | None = None


@dataclass
class FakeConnectorOutput:
    finished_sending: set[str] = field(default_factory=set)
    kv_connector_worker_meta: Any = None


def producer_request(n: int) -> FakeRequest:
    return FakeRequest("p1", n, SendParams("t1", "127.0.0.1:1", "grpc", 7, "abc").to_params())


def test_producer_ships_all_prompt_blocks_in_the_completing_step() -> None:
    side = SchedulerSide(BS, is_producer=True)
    req = producer_request(300)  # 3 blocks, the last one partial
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks([4, 9, 2, 8]), 0)  # type: ignore[arg-type]
    # chunked prefill: the first chunk does not complete the prompt
    so = FakeSchedulerOutput({"p1": 256}, FakeBlockState({"p1": [4, 9, 2, 8]}))
    assert side.build_connector_meta(so).saves == []  # type: ignore[arg-type]
    req.num_computed_tokens = 256
    meta = side.build_connector_meta(  # type: ignore[arg-type]
        FakeSchedulerOutput({"p1": 44}, FakeBlockState({"p1": [4, 9, 2, 8]}))
    )
    (job,) = meta.saves
    assert job.block_ids == [4, 9, 2] and job.num_tokens == 300
    assert (job.transfer_id, job.decode_epoch, job.decode_fingerprint) == ("t1", 7, "abc")
    # finished: blocks stay held until the worker half reports the transfer over
    assert side.request_finished(req, [4, 9, 2]) == (True, None)  # type: ignore[arg-type]
    side.update_connector_output(FakeConnectorOutput({"p1"}))  # type: ignore[arg-type]


def test_producer_frees_at_once_when_nothing_was_shipped() -> None:
    side = SchedulerSide(BS, is_producer=True)
    req = producer_request(300)
    side.update_state_after_alloc(req, FakeBlocks([1, 2, 3]), 0)  # type: ignore[arg-type]
    # aborted before the prompt completed
    assert side.request_finished(req, [1, 2, 3]) == (False, None)  # type: ignore[arg-type]
    plain = FakeRequest("p2", 50, None)
    side.update_state_after_alloc(plain, FakeBlocks([5]), 0)  # type: ignore[arg-type]
    assert side.request_finished(plain, [5]) == (False, None)  # type: ignore[arg-type]


def test_consumer_claims_the_remote_tokens_beyond_its_local_prefix() -> None:
    side = SchedulerSide(BS, is_producer=False)
    req = FakeRequest("d1", 301, RecvParams("t1", 300).to_params())  # prompt + token 1
    # 128 tokens already cached locally: claim the other 172, asynchronously
    assert side.get_num_new_matched_tokens(req, 128) == (172, True)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks([10, 11, 12]), 172)  # type: ignore[arg-type]
    meta = side.build_connector_meta(FakeSchedulerOutput({}))  # type: ignore[arg-type]
    (job,) = meta.loads
    assert job.local_block_ids == [11, 12] and job.remote_first_block == 1
    # while loading, a second look claims nothing new
    assert side.get_num_new_matched_tokens(req, 128) == (0, False)  # type: ignore[arg-type]
    report = LoadReport("d1", "t1", ok=True, nbytes=99)
    side.update_connector_output(  # type: ignore[arg-type]
        FakeConnectorOutput(kv_connector_worker_meta=LoadReports([report]))
    )
    delay, params = side.request_finished(req, [10, 11, 12])  # type: ignore[arg-type]
    assert not delay and params == {LOAD_KEY: report.to_dict()}


def test_consumer_never_claims_the_last_token_or_a_full_local_hit() -> None:
    side = SchedulerSide(BS, is_producer=False)
    req = FakeRequest("d2", 129, RecvParams("t2", 500).to_params())  # more than the prompt holds
    assert side.get_num_new_matched_tokens(req, 0) == (128, True)  # type: ignore[arg-type]
    hit = FakeRequest("d3", 257, RecvParams("t3", 256).to_params())
    assert side.get_num_new_matched_tokens(hit, 256) == (0, False)  # type: ignore[arg-type]


def test_consumer_abort_while_waiting_cancels_the_load() -> None:
    side = SchedulerSide(BS, is_producer=False)
    req = FakeRequest("d4", 201, RecvParams("t4", 200).to_params())
    side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks([1, 2]), 200)  # type: ignore[arg-type]
    side.build_connector_meta(FakeSchedulerOutput({}))  # type: ignore[arg-type]
    assert side.request_finished(req, [1, 2]) == (False, None)  # type: ignore[arg-type]
    meta = side.build_connector_meta(FakeSchedulerOutput({}))  # type: ignore[arg-type]
    assert meta.cancelled_loads == ["d4"]
