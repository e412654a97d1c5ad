"""Routing policies: pure functions of registry records and local in-flight counts."""

from __future__ import annotations

from collections import Counter

from services.registry.records import WorkerLoad, WorkerRecord
from services.router.policies import (
    Choice,
    LoadAware,
    LocalLoad,
    RoundRobin,
    RouteInput,
    prefill_pool_full,
    unpaired,
)


def worker(wid: str, role: str, host: str = "h1", fp: str = "f", capacity: int = 8,
           updated: float = 0.0, **load: float) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, role=role, address=f"{wid}:1", host=host, epoch=1,
                        fingerprint=fp, capacity=capacity, updated=updated,
                        load=WorkerLoad(**load))  # type: ignore[arg-type]


def test_round_robin_alternates_and_skips_full_decoders() -> None:
    rr = RoundRobin()
    prefills = [worker("p1", "prefill"), worker("p2", "prefill")]
    decodes = [worker("d1", "decode"), worker("d2", "decode", running=8)]
    picks = [rr.choose(prefills, decodes, RouteInput(10), LocalLoad()) for _ in range(4)]
    assert Counter(c.prefill.worker_id for c in picks if c and c.prefill) == {"p1": 2, "p2": 2}
    assert {c.decode.worker_id for c in picks if c} == {"d1"}


def test_no_decode_room_means_no_choice() -> None:
    full = [worker("d1", "decode", kv_usage=0.99), worker("d2", "decode", running=5, waiting=3)]
    assert LoadAware().choose([worker("p1", "prefill")], full, RouteInput(10), LocalLoad()) is None
    assert RoundRobin().choose([worker("p1", "prefill")], full, RouteInput(10),
                               LocalLoad()) is None


def test_prefill_by_queued_tokens_including_local_in_flight() -> None:
    policy = LoadAware()
    prefills = [worker("p1", "prefill", queued_prompt_tokens=100),
                worker("p2", "prefill", queued_prompt_tokens=300)]
    decodes = [worker("d1", "decode")]
    assert policy.choose(prefills, decodes, RouteInput(50), LocalLoad()).prefill.worker_id == "p1"  # type: ignore[union-attr]
    local = LocalLoad()
    local.sent("p1", 400)
    assert policy.choose(prefills, decodes, RouteInput(50), local).prefill.worker_id == "p2"  # type: ignore[union-attr]


def test_a_conversations_next_turn_stays_with_the_worker_prefilling_its_last_one() -> None:
    """The worker holding a conversation's prefix is busy with another turn it mostly
    looks up: its queue counts that turn's cached prefix (vLLM's queue counts whole
    prompts), which the router takes off, so the next turn goes where its prefix is
    rather than to an idle worker that would compute it all again."""
    import time

    from services.router.policies import prefill_queue

    local = LocalLoad()
    local.sent("p1", 1963, cached=1024)  # the other conversation's turn, still prefilling
    reported = worker("p1", "prefill", updated=time.time() + 1, queued_prompt_tokens=1963)
    idle = worker("p2", "prefill", updated=time.time() + 1)
    assert prefill_queue(reported, local) == 939  # what p1 still computes
    unreported = worker("p1", "prefill", updated=time.time() - 60)
    assert prefill_queue(unreported, local) == 939  # the same from the router's own count
    route = RouteInput(1949, {"p1": 1920, "p2": 128}, precise=True)
    choice = LoadAware().choose([reported, idle], [worker("d1", "decode")], route, local)
    assert choice is not None and choice.prefill is not None
    assert (choice.prefill.worker_id, choice.reason) == ("p1", "prefix")


def test_a_prompt_prefilled_since_the_report_leaves_the_reported_queue() -> None:
    """A report written while a prompt was queued still counts it after its first token
    came back: the router takes it off until a later report shows the queue without it,
    so the worker that just served a conversation's turn is not taken for busy."""
    import time

    from services.router.policies import prefill_queue

    local = LocalLoad()
    flight = local.sent("p1", 660)
    report = worker("p1", "prefill", updated=time.time() + 0.5, queued_prompt_tokens=700)
    time.sleep(0.01)
    assert prefill_queue(report, local) == 700  # not prefilled yet: the report is right
    time.sleep(0.5)
    local.prefilled(flight)
    assert prefill_queue(report, local) == 40  # the 660 are done; 40 are someone else's
    later = worker("p1", "prefill", updated=time.time() + 1, queued_prompt_tokens=40)
    assert prefill_queue(later, local) == 40  # a later report shows it: nothing taken off
    assert not local.drained


def test_prefix_hits_pull_towards_the_worker_holding_the_prefix() -> None:
    policy = LoadAware()
    prefills = [worker("p1", "prefill", queued_prompt_tokens=200), worker("p2", "prefill")]
    choice = policy.choose(prefills, [worker("d1", "decode")],
                           RouteInput(1000, prefix_hits={"p1": 896}), LocalLoad())
    assert choice is not None and choice.prefill is not None
    assert (choice.prefill.worker_id, choice.reason) == ("p1", "prefix")


def test_same_host_pair_preferred_and_layouts_must_match() -> None:
    policy = LoadAware(transfer_cost_tokens=1000)
    prefills = [worker("p1", "prefill", host="a"), worker("p2", "prefill", host="b")]
    decodes = [worker("d1", "decode", host="b")]
    choice = policy.choose(prefills, decodes, RouteInput(100), LocalLoad())
    assert choice is not None and choice.prefill is not None
    assert choice.prefill.worker_id == "p2"
    other = [worker("p3", "prefill", fp="other")]
    fallback = policy.choose(other, decodes, RouteInput(100), LocalLoad())
    assert fallback is not None and fallback.prefill is None
    assert fallback.reason == "local_no_prefill"


def test_a_decode_worker_no_prefill_worker_can_feed_is_named_with_why() -> None:
    d = WorkerRecord(worker_id="d1", role="decode", address="d1:1", host="h1", epoch=1,
                     fingerprint="aa", tp=1, kv_heads=8, block_size=16)
    p = WorkerRecord(worker_id="p1", role="prefill", address="p1:1", host="h1", epoch=1,
                     fingerprint="bb", tp=2, kv_heads=4, block_size=16)
    (line,) = unpaired([p, d])
    assert "decode worker d1" in line and "p1: tensor-parallel size 2 != 1" in line
    assert "KV heads per rank 4 != 8" in line and "block size" not in line
    assert unpaired([p, d, worker("p2", "prefill", fp="aa")]) == []  # one partner is enough
    assert unpaired([d]) == []  # no prefill pool: not a mismatch


def test_conditional_disaggregation() -> None:
    policy = LoadAware(local_prefill_max_tokens=64, saturated_queue_tokens=1000)
    prefills = [worker("p1", "prefill")]
    decodes = [worker("d1", "decode")]
    short = policy.choose(prefills, decodes, RouteInput(64), LocalLoad())
    assert short is not None and (short.prefill, short.reason) == (None, "local_short_prompt")
    long = policy.choose(prefills, decodes, RouteInput(65), LocalLoad())
    assert long is not None and long.prefill is not None
    busy = [worker("p1", "prefill", queued_prompt_tokens=5000)]
    saturated = policy.choose(busy, decodes, RouteInput(500), LocalLoad())
    assert saturated is not None and saturated.reason == "local_prefill_saturated"


def test_prefix_holder_wins_over_a_lagging_load_report_until_saturated() -> None:
    policy = LoadAware(saturated_queue_tokens=4096)
    decodes = [worker("d1", "decode")]
    hits = RouteInput(660, prefix_hits={"p1": 640})
    busy_looking = [worker("p1", "prefill", queued_prompt_tokens=660), worker("p2", "prefill")]
    choice = policy.choose(busy_looking, decodes, hits, LocalLoad())
    assert choice is not None and choice.prefill is not None
    assert (choice.prefill.worker_id, choice.reason) == ("p1", "prefix")
    saturated = [worker("p1", "prefill", queued_prompt_tokens=5000), worker("p2", "prefill")]
    choice = policy.choose(saturated, decodes, hits, LocalLoad())
    assert choice is not None and choice.prefill is not None
    assert (choice.prefill.worker_id, choice.reason) == ("p2", "load")


def test_prefill_pool_bound_counts_reported_and_local_queue() -> None:
    p = worker("p1", "prefill", queued_prompt_tokens=900)
    d = worker("d1", "decode")
    local = LocalLoad()
    assert prefill_pool_full(Choice(p, d, "load"), local, 1000) is None
    local.sent("p1", 100)  # sent since the last heartbeat: 900 + 100 reaches the bound
    message = prefill_pool_full(Choice(p, d, "load"), local, 1000)
    assert message == "the prefill pool has 1000 prompt tokens queued (bound 1000)"
    assert prefill_pool_full(Choice(p, d, "load"), local, 0) is None  # 0: no bound
    assert prefill_pool_full(Choice(None, d, "local_short_prompt"), local, 1) is None


def test_in_flight_counts_cover_only_what_the_last_report_cannot_show() -> None:
    """A request counts from dispatch until a report made after it; its prompt tokens
    only until its first token. (Counting every request to its end, on top of the
    report, doubled the queue of a loaded prefill worker and sent long prompts to the
    decode worker as if the prefill pool were saturated.)"""
    local = LocalLoad()
    long, short = local.sent("p1", 1800), local.sent("p1", 100)
    decoding = local.sent("d1", 0)
    unreported = worker("p1", "prefill")  # no report yet (the local pair: never)
    assert local.prompt_tokens(unreported) == 1900
    local.prefilled(long)  # its first token came back: it is decoding now
    assert local.prompt_tokens(unreported) == 100
    reported = worker("p1", "prefill", updated=short.sent + 1, queued_prompt_tokens=100)
    assert local.prompt_tokens(reported) == 0  # the report shows the short prompt itself
    d = worker("d1", "decode", running=1)
    assert local.requests(d) == 1
    assert local.requests(worker("d1", "decode", updated=decoding.sent + 1, running=1)) == 0
    for flight in (long, short, decoding):
        local.done(flight)
    assert local.flights == {}
    assert local.prompt_tokens(unreported) == 0 and local.requests(d) == 0


def test_precise_hits_are_weighed_against_load_as_one_cost() -> None:
    """With the engines' own KV events a cached prefix is a saving in the one cost, not
    an outright win: a holder whose queue outweighs the saving loses to an idle worker."""
    policy = LoadAware()
    prefills = [worker("p1", "prefill", queued_prompt_tokens=200), worker("p2", "prefill")]
    decodes = [worker("d1", "decode")]
    holds = RouteInput(1000, prefix_hits={"p1": 896}, precise=True)
    choice = policy.choose(prefills, decodes, holds, LocalLoad())
    assert choice is not None and choice.prefill is not None
    assert (choice.prefill.worker_id, choice.reason) == ("p1", "prefix")  # 304 < 1000
    busy = [worker("p1", "prefill", queued_prompt_tokens=2000), worker("p2", "prefill")]
    choice = policy.choose(busy, decodes, holds, LocalLoad())
    assert choice is not None and choice.prefill is not None
    assert (choice.prefill.worker_id, choice.reason) == ("p2", "load")  # 2104 > 1000
    # The approximate index still lets the holder win until its queue is saturated.
    approximate = RouteInput(1000, prefix_hits={"p1": 896})
    choice = policy.choose(busy, decodes, approximate, LocalLoad())
    assert choice is not None and choice.prefill is not None
    assert (choice.prefill.worker_id, choice.reason) == ("p1", "prefix")


def test_the_decode_worker_holding_the_prompt_saves_the_transfer() -> None:
    policy = LoadAware(transfer_token_weight=0.5)
    prefills = [worker("p1", "prefill")]
    decodes = [worker("d1", "decode"), worker("d2", "decode", running=1)]
    # d2 is a little busier (decode cost 64), but holds 768 of the 1000 prompt tokens:
    # 0.5 * 232 + 64 < 0.5 * 1000.
    route = RouteInput(1000, decode_hits={"d2": 768}, precise=True)
    choice = policy.choose(prefills, decodes, route, LocalLoad())
    assert choice is not None and choice.prefill is not None
    assert (choice.decode.worker_id, choice.reason) == ("d2", "decode_prefix")
    # Without the weight, transfers cost nothing and the idler decode worker wins.
    choice = LoadAware(transfer_token_weight=0).choose(prefills, decodes, route, LocalLoad())
    assert choice is not None and (choice.decode.worker_id, choice.reason) == ("d1", "load")


def test_one_cost_adds_prefill_queue_uncached_prompt_and_weighted_transfer() -> None:
    policy = LoadAware(transfer_token_weight=0.25, transfer_cost_tokens=256)
    p = worker("p1", "prefill", queued_prompt_tokens=100)
    d = worker("d1", "decode", host="h2")
    route = RouteInput(1000, prefix_hits={"p1": 600}, decode_hits={"d1": 200}, precise=True)
    assert policy.prefill_cost(p, route, LocalLoad()) == 100 + 400
    assert policy.transfer_cost(p, d, route) == 0.25 * 800 + 256


def test_on_equal_cost_the_pair_caching_more_wins() -> None:
    """A report written while the holder prefilled turn 1 still counts that prompt as
    queued: the holder's saving and its stale queue cancel out, and the tie goes to it."""
    prefills = [worker("p1", "prefill"), worker("p2", "prefill", queued_prompt_tokens=768)]
    route = RouteInput(1000, prefix_hits={"p2": 768}, precise=True)
    choice = LoadAware().choose(prefills, [worker("d1", "decode")], route, LocalLoad())
    assert choice is not None and choice.prefill is not None
    assert (choice.prefill.worker_id, choice.reason) == ("p2", "prefix")
