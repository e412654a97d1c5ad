"""The decode worker's log of a late decode leg: where the time between the end of the
prefill and the first decode step went."""

from __future__ import annotations

import logging

import pytest

from pdserve.v1 import worker_pb2 as wpb
from services.kv.params import LoadReport
from services.worker.decode import SLOW_LEG_LOG_S, slow_leg

DONE = 1000.0  # the prefill's end, on the wall clock


def request() -> wpb.DecodeRequest:
    req = wpb.DecodeRequest(request_id="r1")
    req.handle.transfer_id = "t1"
    req.handle.prefill_worker_id = "prefill-0"
    req.handle.prefill_done_wall = DONE
    return req


def test_a_late_kv_arrival_is_logged_with_each_wait(caplog: pytest.LogCaptureFixture) -> None:
    report = LoadReport(req_id="x", transfer_id="t1", ok=True, nbytes=10,
                        first_byte_wall=DONE + 0.5, last_byte_wall=DONE + 30.0)
    with caplog.at_level(logging.WARNING, "services.worker.decode"):
        slow_leg(request(), DONE + 0.2, DONE + 31.0, report)
    [record] = caplog.records
    msg = record.getMessage()
    assert "request r1: first decode step 31.00 s after its prefill finished" in msg
    assert "the Decode call arrived at +0.20 s" in msg
    assert "KV first byte +0.50 s, last byte +30.00 s" in msg
    assert "first step 30.80 s after the call (transfer t1 from prefill-0)" in msg


def test_a_late_call_without_kv_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "services.worker.decode"):
        slow_leg(request(), DONE + 40.0, DONE + 40.1, None)
    [record] = caplog.records
    assert "the Decode call arrived at +40.00 s, no KV loaded" in record.getMessage()


def test_a_prompt_leg_on_time_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "services.worker.decode"):
        slow_leg(request(), DONE + 0.1, DONE + SLOW_LEG_LOG_S - 0.01, None)
        unstamped = request()
        unstamped.handle.prefill_done_wall = 0.0  # an older prefill worker's handle
        slow_leg(unstamped, 5.0, 50.0, None)
    assert caplog.records == []
