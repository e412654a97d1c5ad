"""Pair choice for requests under a LoRA adapter (pure logic over registry records):
prefill and decode of one request must both hold the adapter, holders come first, and
the workers of a pair chosen without them are named to load it. Plus the records and
the prefix index that carry adapters."""

from __future__ import annotations

import json
import time

import pytest

from services.registry.records import BadRecord, WorkerLoad, WorkerRecord
from services.router.policies import (
    AdapterOverlay,
    LoadAware,
    LocalLoad,
    RoundRobin,
    RouteInput,
    choose_with_adapter,
)
from services.router.prefix import block_hashes

ADAPTER = ("sql", "/adapters/sql")


def worker(wid: str, role: str, loras: tuple[tuple[str, str], ...] = (), updated: float = 0.0,
           **load: float) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, role=role, address=f"{wid}:1", host="h1", epoch=1,
                        fingerprint="f", capacity=8, updated=updated, loras=loras,
                        load=WorkerLoad(**load))  # type: ignore[arg-type]


def holds(name: str):  # type: ignore[no-untyped-def]
    return lambda w: name in w.adapters


@pytest.mark.parametrize("policy", [LoadAware(), RoundRobin()], ids=["load", "round_robin"])
def test_a_pair_of_holders_wins_over_idle_workers_without_it(policy: object) -> None:
    prefills = [worker("p1", "prefill"), worker("p2", "prefill", (ADAPTER,),
                                                 queued_prompt_tokens=2000)]
    decodes = [worker("d1", "decode"), worker("d2", "decode", (ADAPTER,), running=5)]
    for _ in range(3):
        plan = choose_with_adapter(policy, prefills, decodes, RouteInput(100), LocalLoad(),
                                   holds("sql"))  # type: ignore[arg-type]
        assert plan is not None and plan.load == ()
        assert plan.choice.prefill is not None
        assert (plan.choice.prefill.worker_id, plan.choice.decode.worker_id) == ("p2", "d2")


def test_without_a_holding_pair_the_chosen_workers_load_it() -> None:
    prefills = [worker("p1", "prefill"), worker("p2", "prefill", queued_prompt_tokens=900)]
    decodes = [worker("d1", "decode", (ADAPTER,)), worker("d2", "decode", running=6)]
    plan = choose_with_adapter(LoadAware(), prefills, decodes, RouteInput(100), LocalLoad(),
                               holds("sql"))
    assert plan is not None and plan.choice.prefill is not None
    # The policy picks the least loaded pair; only the worker lacking the adapter loads.
    assert (plan.choice.prefill.worker_id, plan.choice.decode.worker_id) == ("p1", "d1")
    assert [w.worker_id for w in plan.load] == ["p1"]
    none = choose_with_adapter(LoadAware(), prefills, [worker("d2", "decode")], RouteInput(100),
                               LocalLoad(), holds("sql"))
    assert none is not None
    assert sorted(w.worker_id for w in none.load) == ["d2", "p1"]


def test_full_holders_send_the_request_to_workers_that_load_it() -> None:
    decodes = [worker("d1", "decode", (ADAPTER,), running=8), worker("d2", "decode")]
    plan = choose_with_adapter(LoadAware(), [], decodes, RouteInput(100), LocalLoad(),
                               holds("sql"))
    assert plan is not None and plan.choice.decode.worker_id == "d2"
    assert [w.worker_id for w in plan.load] == ["d2"]
    assert choose_with_adapter(LoadAware(), [], decodes[:1], RouteInput(100), LocalLoad(),
                               holds("sql")) is None


def test_a_decode_holder_alone_serves_where_there_is_no_prefill_pool() -> None:
    decodes = [worker("d1", "decode", (ADAPTER,)), worker("d2", "decode")]
    plan = choose_with_adapter(LoadAware(), [], decodes, RouteInput(100), LocalLoad(),
                               holds("sql"))
    assert plan is not None and plan.load == () and plan.choice.prefill is None
    assert plan.choice.decode.worker_id == "d1"
    # With a short-prompt policy the decode holder prefills too: nothing to load.
    short = LoadAware(local_prefill_max_tokens=200)
    plan = choose_with_adapter(short, [worker("p1", "prefill")], decodes, RouteInput(100),
                               LocalLoad(), holds("sql"))
    assert plan is not None and plan.load == () and plan.choice.reason == "local_short_prompt"


def test_the_overlay_counts_changes_until_a_newer_report_shows_them() -> None:
    overlay = AdapterOverlay()
    before = worker("d1", "decode", updated=time.time() - 5)
    overlay.loaded("d1", *ADAPTER)
    assert overlay.held(before) == {"sql": "/adapters/sql"}
    # A fixed view (no reports: updated 0) is known by the changes alone.
    assert overlay.held(worker("d1", "decode")) == {"sql": "/adapters/sql"}
    after = worker("d1", "decode", updated=time.time() + 1)  # a report without it: unloaded
    assert overlay.held(after) == {}
    overlay.unloaded("d1", "sql")
    assert overlay.held(worker("d1", "decode", (ADAPTER,), updated=time.time() - 5)) == {}
    overlay.prune([after])
    assert overlay.changes == {}
    overlay.loaded("gone", *ADAPTER)
    overlay.prune([before])
    assert "gone" not in overlay.changes


def test_records_carry_adapters_and_refuse_bad_ones() -> None:
    record = worker("d1", "decode", (("b", "/y"), ("a", "/x")))
    back = WorkerRecord.from_json(json.dumps(record.to_dict()))
    assert back.adapters == {"a": "/x", "b": "/y"}
    assert back.loras == (("a", "/x"), ("b", "/y"))
    old = record.to_dict()
    del old["loras"]  # an older writer
    assert WorkerRecord.from_dict(old).adapters == {}
    for bad in ("sql", [["sql"]], [["sql", 3]], [["", "/x"]]):
        with pytest.raises(BadRecord, match="loras"):
            WorkerRecord.from_dict({**record.to_dict(), "loras": bad})


def test_prefix_hashes_of_an_adapter_are_its_own() -> None:
    ids = list(range(64))
    base = block_hashes(ids, 16)
    sql = block_hashes(ids, 16, salt="sql")
    assert len(base) == len(sql) == 4
    assert not set(base) & set(sql)
    assert block_hashes(ids, 16, salt="sql") == sql
    assert not set(block_hashes(ids, 16, salt="chat")) & set(sql)
