"""The chaos and soak analysis against hand-built records: fault specs, token identity,
gaps attributed to faults, first service after a fault, growth of a series."""

from __future__ import annotations

import pytest

from services.bench.chaos_report import first_served, growth, longest_gaps, summarize_chaos
from services.bench.faults import Fault, FaultEvent
from services.bench.tokens import Tokens
from services.traffic.record import RequestRecord


def rec(index: int, send: float, chunks: list[float], ok: bool = True,
        code: str = "") -> RequestRecord:
    return RequestRecord(
        run="chaos", index=index, request_id=f"bench-chaos-{index}-1", kind="chat",
        prompt_tokens=4, max_tokens=len(chunks) or 3, scheduled_s=0.0, send_time=send,
        chunk_offsets=chunks, chunk_tokens=[1] * len(chunks), e2e_s=chunks[-1] if chunks
        else 1.0, ok=ok, error_code=code)


def test_fault_specs_parse_and_bad_ones_are_refused() -> None:
    assert Fault.parse("kill-decode@30") == Fault("kill-decode", 30.0)
    stop = Fault.parse("stop-decode@190:7.5")
    assert (stop.role, stop.stop_s, stop.label()) == ("decode", 7.5, "stop-decode 7.5 s")
    for bad in ("kill-router@3", "kill-decode", "kill-decode@x", "stop-decode@1:0"):
        with pytest.raises(ValueError):
            Fault.parse(bad)


def test_identity_divergence_errors_and_migrations_are_counted() -> None:
    records = [rec(0, 10.0, [0.1, 0.2, 0.3]), rec(1, 11.0, [0.1, 0.2, 0.3]),
               rec(2, 12.0, [0.1], ok=False, code="UNAVAILABLE")]
    tokens = {0: Tokens([5, 6, 7], migrations=1), 1: Tokens([5, 9, 7]), 2: Tokens([5])}
    reference = [[5, 6, 7], [5, 6, 7], [5, 6, 7]]
    s = summarize_chaos(records, tokens, reference, [])
    assert (s["sent"], s["finished"], s["lost"], s["finished_identical"]) == (3, 2, 1, 1)
    assert s["errors"] == {"UNAVAILABLE": 1}
    assert (s["migrations"], s["migrated_requests"]) == (1, 1)
    assert s["not_identical"] == [{"index": 1, "request_id": "bench-chaos-1-1",
                                   "kind": "chat", "migrations": 0, "first_divergence": 1,
                                   "tokens": 3, "ok": True}]
    # no reference: nothing is called identical
    assert summarize_chaos(records, tokens, None, [])["finished_identical"] is None


def test_a_gap_is_attributed_to_the_last_fault_before_it_ended() -> None:
    kill = FaultEvent(Fault("kill-decode", 5.0), at=105.0)
    redis = FaultEvent(Fault("kill-redis", 50.0), at=150.0)
    records = [rec(0, 100.0, [0.1, 0.2, 9.2, 9.3]), rec(1, 140.0, [0.5, 11.0, 11.5])]
    gaps = longest_gaps(records, [kill, redis])
    assert gaps[0]["gap_s"] == pytest.approx(10.5)
    assert gaps[0]["fault"] == "kill-redis"
    assert gaps[0]["since_fault_s"] == pytest.approx(140.5 - 150.0)
    assert gaps[1]["gap_s"] == pytest.approx(9.0)
    assert (gaps[1]["fault"], gaps[1]["request_id"]) == ("kill-decode", "bench-chaos-0-1")


def test_first_served_is_the_first_token_of_the_first_request_sent_after() -> None:
    kill = FaultEvent(Fault("kill-decode", 5.0), at=105.0)
    records = [rec(0, 100.0, [0.1]), rec(1, 106.0, [], ok=False), rec(2, 107.0, [1.5])]
    served = first_served(records, kill)
    assert served["request_id"] == "bench-chaos-2-1"
    assert served["first_token_after_fault_s"] == pytest.approx(3.5)
    assert first_served(records[:2], kill)["first_token_after_fault_s"] is None


def test_growth_is_taken_between_the_window_ends_skipping_missing_samples() -> None:
    g = growth([100.0, None, 104.0, 110.0, 500.0], [0, 300, 400, 600, 700], 300, 650)
    assert (g["from"], g["to"], g["change"]) == (104.0, 110.0, 6.0)
    assert g["relative"] == pytest.approx(6 / 104)
    assert growth([None, None], [0, 1], 0, 1)["change"] is None


def test_reference_outputs_are_reused_only_for_the_same_requests(tmp_path) -> None:
    import json
    import subprocess

    from services.bench.reference import greedy_reference
    from services.traffic.request import RequestSpec

    specs = [RequestSpec([1, 2, 3], 2), RequestSpec([4, 5], 3)]
    requests = json.dumps([{"prompt_token_ids": s.prompt_ids, "max_tokens": s.output_len}
                           for s in specs])
    (tmp_path / "reference-requests.json").write_text(requests)
    (tmp_path / "reference-outputs.json").write_text(json.dumps([[7, 8], [9, 9, 9]]))
    # The same requests: no engine is started (the model folder does not exist).
    assert greedy_reference(str(tmp_path / "no-model"), specs, tmp_path) == [[7, 8], [9, 9, 9]]
    # Other requests: the stale outputs are not returned; generation is attempted (and
    # fails here, without a model).
    with pytest.raises(subprocess.CalledProcessError):
        greedy_reference(str(tmp_path / "no-model"), [RequestSpec([1, 2, 3], 5)], tmp_path,
                         timeout_s=120)
    assert not (tmp_path / "reference-outputs.json").exists()
