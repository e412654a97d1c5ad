"""KV computed under a LoRA adapter is tagged with it from the prefill engine's scheduler
to the transfer header, and the decode engine's consumer loads it only into a request
under the same adapter. Driven with the stand-ins (Fake*) of the scheduler-side tests."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from services.kv.consumer import Consumer
from services.kv.metadata import LoadJob
from services.kv.params import RecvParams, SendParams
from services.kv.scheduler_side import SchedulerSide
from services.kv.transport.frames import spec_from_dict, spec_to_dict
from services.kv.transport.spec import ReceivedKV, TransferSpec
from tests.unit.test_kv_scheduler_side import (
    BS,
    FakeBlocks,
    FakeBlockState,
    FakeRequest,
    FakeSchedulerOutput,
)


@dataclass
class FakeLoraRequest:
    lora_name: str


@dataclass
class FakeAdapterRequest(FakeRequest):
    lora_request: Any = None


def spec(lora: str = "") -> TransferSpec:
    return TransferSpec("t1", 2, (3, 1, BS, 8), torch.float32, 300, 7, "abc", lora=lora)


def test_the_transfer_header_carries_the_adapter() -> None:
    assert spec_from_dict(spec_to_dict(spec("sql"))).lora == "sql"
    older = spec_to_dict(spec())
    del older["lora"]  # a sender from before adapters: the base model's KV
    assert spec_from_dict(older).lora == ""


def test_save_and_load_jobs_name_the_requests_adapter() -> None:
    producer = SchedulerSide(BS, is_producer=True)
    req = FakeAdapterRequest("p1", 300, SendParams("t1", "127.0.0.1:1", "grpc", 7,
                                                   "abc").to_params(),
                             lora_request=FakeLoraRequest("sql"))
    producer.update_state_after_alloc(req, FakeBlocks([4, 9, 2]), 0)  # type: ignore[arg-type]
    meta = producer.build_connector_meta(  # type: ignore[arg-type]
        FakeSchedulerOutput({"p1": 300}, FakeBlockState({"p1": [4, 9, 2]})))
    assert [job.lora for job in meta.saves] == ["sql"]

    consumer = SchedulerSide(BS, is_producer=False)
    for rid, lora in (("d1", FakeLoraRequest("sql")), ("d2", None)):
        d = FakeAdapterRequest(rid, 301, RecvParams("t-" + rid, 300).to_params(),
                               lora_request=lora)
        consumer.get_num_new_matched_tokens(d, 0)  # type: ignore[arg-type]
        consumer.update_state_after_alloc(d, FakeBlocks([1, 2, 3]), 300)  # type: ignore[arg-type]
    loads = consumer.build_connector_meta(FakeSchedulerOutput({})).loads  # type: ignore[arg-type]
    assert [(job.req_id, job.lora) for job in loads] == [("d1", "sql"), ("d2", "")]


def test_the_consumer_refuses_kv_of_another_adapter() -> None:
    """Checked before a byte is copied: the stand-in consumer has no caches at all."""
    kv = ReceivedKV(spec("sql"), [], 0, 0.0, 0.0)
    fake_consumer = SimpleNamespace()
    for job_lora, kv_lora in (("", "sql"), ("sql", ""), ("poet", "sql")):
        kv.spec = spec(kv_lora)
        error = Consumer._copy_in(fake_consumer, LoadJob("d1", "t1", [1], 0,  # type: ignore[arg-type]
                                                           lora=job_lora), kv)
        assert error.startswith("the KV was computed with LoRA adapter"), error
