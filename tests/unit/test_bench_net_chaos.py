"""The network chaos analysis against hand-built records: network fault specs, which
streams are clean (token-identical, or one status after a prefix of the undisturbed
answer), and the requests sent while a fault lasted."""

from __future__ import annotations

import pytest

from services.bench.chaos_report import summarize_chaos
from services.bench.faults import Fault, FaultEvent
from services.bench.tokens import Tokens
from services.traffic.record import RequestRecord


def rec(index: int, send: float, n: int, ok: bool = True, code: str = "") -> RequestRecord:
    chunks = [0.1 * (k + 1) for k in range(n)]
    return RequestRecord(
        run="net", index=index, request_id=f"bench-net-{index}-1", kind="chat",
        prompt_tokens=4, max_tokens=3, scheduled_s=0.0, send_time=send,
        chunk_offsets=chunks, chunk_tokens=[1] * n, e2e_s=chunks[-1] if chunks else 1.0,
        ok=ok, error_code=code)


def test_network_fault_specs_carry_how_long_and_how_much() -> None:
    loss = Fault.parse("loss@125:15:0.05")
    assert (loss.network, loss.stop_s, loss.amount) == (True, 15.0, 0.05)
    assert loss.label() == "loss 5% 15 s"
    assert Fault.parse("loss@1:2").amount == 0.1  # the default share
    latency = Fault.parse("latency@160:15")
    assert (latency.amount, latency.label()) == (100.0, "latency +100 ms 15 s")
    cut = Fault.parse("cut-router-redis@95:10")
    assert (cut.network, cut.label()) == (True, "cut-router-redis 10 s")
    assert not Fault.parse("kill-decode@3").network
    for bad in ("loss@1:5:1.5", "cut-router@3:5", "latency@1:5:-3", "partition-decode@1:0"):
        with pytest.raises(ValueError):
            Fault.parse(bad)


def test_a_stream_is_clean_when_identical_or_one_status_after_a_prefix() -> None:
    reference = [[5, 6, 7]] * 5
    records = [rec(0, 10.0, 3),  # identical
               rec(1, 11.0, 1, ok=False, code="UNAVAILABLE"),  # a prefix, then a status
               rec(2, 12.0, 2, ok=False, code="ABORTED"),  # a wrong token before it
               rec(3, 13.0, 3),  # finished with a token lost and one duplicated
               rec(4, 14.0, 0, ok=False, code="UNAVAILABLE")]  # nothing, then a status
    tokens = {0: Tokens([5, 6, 7]), 1: Tokens([5]), 2: Tokens([5, 9]), 3: Tokens([5, 5, 7]),
              4: Tokens([])}
    s = summarize_chaos(records, tokens, reference, [])
    assert (s["clean"], sorted(s["not_clean"])) == (3, [2, 3])
    assert summarize_chaos(records, tokens, None, [])["clean"] is None


def test_requests_sent_while_a_fault_lasted_are_counted_with_their_ends() -> None:
    cut = FaultEvent(Fault("partition-decode", 10.0, 5.0), at=100.0, resumed_at=105.0,
                     target="decode-grpc<->everyone")
    records = [rec(0, 99.0, 3), rec(1, 101.0, 3), rec(2, 104.0, 1, ok=False,
                                                      code="UNAVAILABLE"), rec(3, 106.0, 3)]
    tokens = {i: Tokens([5, 6, 7][:len(r.chunk_offsets)]) for i, r in enumerate(records)}
    s = summarize_chaos(records, tokens, [[5, 6, 7]] * 4, [cut])
    assert s["faults"][0]["during"] == {"sent": 2, "finished": 1, "clean": 2,
                                        "errors": {"UNAVAILABLE": 1}}
    assert s["faults"][0]["target"] == "decode-grpc<->everyone"
