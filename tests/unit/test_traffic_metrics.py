"""Latency, SLO and summary math over request records, against hand-computed cases."""

from __future__ import annotations

import math

import pytest

from services.traffic.latency import anatomy, itls, output_tokens, tpot
from services.traffic.record import RequestRecord, ServerTimings
from services.traffic.slo import SLOs
from services.traffic.summary import stats, summarize


def rec(chunks: list[float], e2e: float, *, send: float = 100.0, out: int | None = None,
        ok: bool = True, code: str = "", warmup: bool = False, kind: str = "random",
        prompt: int = 10, server: ServerTimings | None = None) -> RequestRecord:
    return RequestRecord(
        run="r", index=0, request_id="x", kind=kind, prompt_tokens=prompt,
        max_tokens=out or len(chunks), scheduled_s=0.0, warmup=warmup, send_time=send,
        chunk_offsets=chunks, chunk_tokens=[1] * len(chunks), e2e_s=e2e,
        output_tokens=len(chunks) if out is None else out, ok=ok, error_code=code,
        server=server)


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    r = rec([0.1, 0.2, 0.3, 0.4], e2e=0.5)
    assert tpot(r) == pytest.approx((0.5 - 0.1) / 3)
    assert r.ttft_s == 0.1


def test_one_token_outputs_are_left_out_of_tpot_but_not_ttft() -> None:
    one = rec([0.2], e2e=0.25)
    assert tpot(one) is None
    s = summarize([one, rec([0.1, 0.3], e2e=0.3)])
    assert s["tpot_s"]["count"] == 1
    assert s["tpot_s"]["mean"] == pytest.approx(0.2)
    assert s["ttft_s"]["count"] == 2


def test_itl_is_every_gap_between_chunks_over_all_requests() -> None:
    a, b = rec([0.1, 0.2, 0.5], e2e=0.5), rec([1.0, 1.25], e2e=1.3)
    assert itls(a) == pytest.approx([0.1, 0.3])
    s = summarize([a, b])
    assert s["itl_s"]["count"] == 3
    assert s["itl_s"]["max"] == pytest.approx(0.3)
    assert s["itl_s"]["mean"] == pytest.approx((0.1 + 0.3 + 0.25) / 3)


def test_output_tokens_prefers_usage_then_chunk_tokens_then_chunks() -> None:
    r = rec([0.1, 0.2], e2e=0.3, out=7)
    assert output_tokens(r) == 7
    r.output_tokens = 0
    r.chunk_tokens = [3, 2]
    assert output_tokens(r) == 5
    r.chunk_tokens = [0, 0]  # the SSE target does not know tokens per chunk
    assert output_tokens(r) == 2


def test_percentiles_on_a_small_sample_interpolate_linearly() -> None:
    s = stats([4.0, 1.0, 3.0, 2.0])
    assert s["count"] == 4
    assert s["p50"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(3.7)  # 1 + 0.9 * 3 = rank 3.7 -> 3 + 0.7
    assert s["p95"] == pytest.approx(3.85)
    assert s["p99"] == pytest.approx(3.97)
    assert s["mean"] == pytest.approx(2.5)
    assert s["std"] == pytest.approx(math.sqrt(1.25))  # population std
    assert (s["min"], s["max"]) == (1.0, 4.0)
    one = stats([0.7])
    assert one["p50"] == one["p99"] == one["mean"] == pytest.approx(0.7)
    assert one["std"] == 0.0


def test_stats_of_nothing_has_a_zero_count_and_no_values() -> None:
    s = stats([])
    assert s["count"] == 0
    assert s["p50"] is None and s["mean"] is None


def test_slo_bounds_are_inclusive() -> None:
    r = rec([0.5, 0.75, 1.0], e2e=1.5)  # TTFT 0.5, TPOT 0.5, largest ITL 0.25, E2E 1.5
    assert SLOs(ttft_s=0.5, tpot_s=0.5, itl_s=0.25, e2e_s=1.5).met(r)
    assert not SLOs(ttft_s=0.4999).met(r)
    assert not SLOs(tpot_s=0.4999).met(r)
    assert not SLOs(itl_s=0.2499).met(r)
    assert not SLOs(e2e_s=1.4999).met(r)


def test_tpot_slo_does_not_apply_to_one_token_outputs() -> None:
    assert SLOs(ttft_s=1.0, tpot_s=0.001).met(rec([0.2], e2e=5.0))


def test_failed_requests_never_meet_slos() -> None:
    assert not SLOs().met(rec([], e2e=0.1, ok=False, code="UNAVAILABLE"))


def test_goodput_counts_requests_meeting_all_slos_over_the_window() -> None:
    records = [
        rec([0.1, 0.2], e2e=0.3, send=100.0),  # good
        rec([0.1, 0.2], e2e=2.0, send=100.0),  # TTFT fine, TPOT 1.9: not good
        rec([0.9, 1.0], e2e=1.1, send=100.5),  # TTFT 0.9: not good; ends at 101.6
        rec([0.1, 0.2], e2e=0.2, send=101.0),  # good
        rec([], e2e=0.5, send=101.5, ok=False, code="RESOURCE_EXHAUSTED"),  # ends at 102.0
    ]
    s = summarize(records, SLOs(ttft_s=0.5, tpot_s=0.5))
    assert s["duration_s"] == pytest.approx(2.0)  # 100.0 -> 102.0
    assert s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(1.0)
    assert s["goodput_share"] == pytest.approx(2 / 5)
    assert s["request_throughput"] == pytest.approx(4 / 2.0)
    assert s["output_token_throughput"] == pytest.approx(8 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((8 + 40) / 2.0)
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["slos"] == {"ttft": 0.5, "tpot": 0.5}


def test_errors_are_grouped_by_status_code_most_common_first() -> None:
    failed = [rec([], 0.1, ok=False, code=c) for c in ("UNAVAILABLE", "HTTP 429", "HTTP 429")]
    s = summarize(failed)
    assert list(s["errors"].items()) == [("HTTP 429", 2), ("UNAVAILABLE", 1)]
    assert s["completed"] == 0 and s["goodput"] == 0.0
    assert s["ttft_s"]["count"] == 0


def test_warmup_requests_are_left_out() -> None:
    s = summarize([rec([5.0, 6.0], e2e=7.0, warmup=True), rec([0.1, 0.2], e2e=0.3)])
    assert s["requests"] == 1 and s["warmup_requests"] == 1
    assert s["ttft_s"]["max"] == pytest.approx(0.1)


def test_by_kind_appears_only_for_mixed_workloads() -> None:
    assert summarize([rec([0.1, 0.2], 0.3)])["by_kind"] == {}
    mixed = summarize([rec([0.1, 0.2], 0.3, kind="chat"), rec([2.0, 2.1], 2.2, kind="long")])
    assert mixed["by_kind"]["long"]["ttft_s"]["p50"] == pytest.approx(2.0)
    assert mixed["by_kind"]["chat"]["ttft_s"]["p50"] == pytest.approx(0.1)


def test_anatomy_parts_add_up_to_the_client_e2e() -> None:
    t = ServerTimings(router_queue_s=0.01, queue_s=0.02, prefill_s=0.3, ttft_s=0.35,
                      kv_transfer_s=0.05, kv_transfer_hidden_s=0.03, decode_queue_s=0.01,
                      decode_s=1.0, e2e_s=1.36)
    r = rec([0.4, 1.4], e2e=1.45, server=t)
    parts = anatomy(r)
    assert parts is not None
    assert parts["kv_transfer"] == pytest.approx(0.02)  # only the part not hidden
    assert parts["first_token_other"] == pytest.approx(0.02)
    assert parts["decode"] == pytest.approx(1.0 - 0.02 - 0.01)
    assert parts["server_other"] == pytest.approx(0.01)
    assert parts["client_network"] == pytest.approx(0.09)
    assert sum(parts.values()) == pytest.approx(1.45)
    s = summarize([r])
    assert s["anatomy"]["requests"] == 1
    assert s["anatomy"]["prefill"]["mean"] == pytest.approx(0.3)


def test_no_anatomy_without_server_timings() -> None:
    assert summarize([rec([0.1, 0.2], 0.3)])["anatomy"] is None


def test_records_round_trip_through_dicts() -> None:
    r = rec([0.1, 0.2], 0.3, server=ServerTimings(prefill_s=0.05, kv_transfer_bytes=9))
    back = RequestRecord.from_dict(r.to_dict())
    assert back == r
