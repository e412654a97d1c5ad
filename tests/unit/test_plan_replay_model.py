"""The planner's picture of a replayed stack: prefix caches per engine, engines
time-sharing cores, the router's own policies and indexes, and turn order
(services/plan/prefix_cache.py, timeshare.py, routing.py, and their use in fleet.py).
Pure logic; the profile is a fake (its numbers are chosen, not measured)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.plan.costmodel import Profile, StepCost, Transport
from services.plan.engine_model import EngineLimits, EngineSim, Job
from services.plan.fleet import Fleet, FleetConfig, PoolSpec, SimRequest
from services.plan.prefix_cache import PrefixCache, block_keys
from services.plan.routing import EngineLoad, Route, RouterModel
from services.plan.timeshare import SharedCores

ONE = StepCost(0.05, 0.001, 0.002, 0.0, 0.0, 0.0)
BLOCK = 4


def profile() -> Profile:
    """A made-up one-core profile (a fake: the numbers are chosen, not measured)."""
    return Profile({"kind": "cpu"}, {"name": "fake", "layers": 1}, {}, "core", {1: ONE},
                   {"shm": Transport(1.0, 0.0)}, 64, 64, 1000, 100_000, 4)


def test_block_keys_chain_so_only_a_shared_prefix_shares_keys() -> None:
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    assert len(a) == 2  # the partial last block has no key
    same_head = block_keys([1, 2, 3, 4, 0, 0, 0, 0], BLOCK)
    assert same_head[0] == a[0] and same_head[1] != a[1]
    other_head = block_keys([0, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert other_head[1] != a[1]  # the same second block after another first one
    with pytest.raises(ValueError):
        block_keys([1], 0)


def test_a_cache_finds_a_leading_run_and_evicts_the_least_recently_used() -> None:
    cache = PrefixCache(capacity=3)
    cache.insert([1, 2])
    assert cache.hits([1, 2, 9]) == 2 and cache.hits([2]) == 1 and cache.hits([9, 1]) == 0
    cache.insert([5])
    cache.match([1])  # 1 is used again: 2 is now the oldest
    cache.insert([6])
    assert 2 not in cache and len(cache) == 3 and cache.hits([1]) == 1
    unbounded = PrefixCache()
    unbounded.insert(range(1000))
    assert len(unbounded) == 1000


def test_steps_sharing_a_core_each_run_at_its_share_of_it() -> None:
    core = SharedCores()
    assert core.start(0, 0.0, 1.0) == {0: 1.0}  # alone: its own time
    ends = core.start(1, 0.5, 1.0)  # 0 has 0.5 s left, 1 has 1 s, each at half speed
    assert ends == pytest.approx({0: 1.5, 1: 2.5})
    assert core.finish(0, 1.5) == pytest.approx({1: 2.0})  # alone again for its last 0.5 s
    assert core.finish(1, 2.0) == {} and len(core) == 0
    core.start(2, 3.0, 1.0)
    with pytest.raises(ValueError, match="already"):
        core.start(2, 3.0, 1.0)


def test_an_engine_computes_only_what_its_cache_lacks_and_at_least_one_token() -> None:
    engine = EngineSim(ONE, EngineLimits(64, 8, 10_000), cache=PrefixCache(100),
                       block_tokens=BLOCK)
    keys = block_keys(list(range(12)), BLOCK)

    def serve(prompt: int, blocks: tuple[int, ...]) -> None:
        engine.submit(Job(len(engine.ends), prompt, 1, blocks=blocks))
        t = 0.0
        while (end := engine.start_step(t)) is not None:
            engine.finish_step()
            t = end

    serve(12, keys)
    assert (engine.computed_tokens, engine.cached_tokens) == (12, 0)
    serve(14, keys)  # three blocks cached, two tokens more
    assert (engine.computed_tokens, engine.cached_tokens) == (14, 12)
    serve(12, keys)  # all cached: vLLM still computes the last token
    assert (engine.computed_tokens, engine.cached_tokens) == (15, 23)
    assert engine.queued_tokens == 0


def disaggregated(routing: str, share: int = 2, local: int = 0) -> FleetConfig:
    pool = PoolSpec(2, 1, share=share)
    return FleetConfig(routing, pool, pool, local_prefill_max_tokens=local, routing=routing,
                       block_tokens=BLOCK)


def test_two_engines_on_one_core_take_twice_as_long_as_on_two() -> None:
    reqs = [SimRequest(0.0, 40, 2), SimRequest(0.0, 40, 2)]
    alone = Fleet(disaggregated("round_robin", share=1), profile()).run(reqs)
    shared = Fleet(disaggregated("round_robin", share=2), profile()).run(reqs)
    for a, s in zip(alone, shared, strict=True):
        assert s.token_times[0] == pytest.approx(2 * a.token_times[0])
    with pytest.raises(ValueError, match="divides"):
        PoolSpec(3, 1, share=2)


def conversation() -> list[SimRequest]:
    """Two turns of one conversation, then an unrelated request: the second turn repeats
    the first's prompt (three blocks) and adds its own."""
    first = block_keys(list(range(12)), BLOCK)
    second = block_keys(list(range(12)) + [99] * 8, BLOCK)
    other = block_keys([50] * 12, BLOCK)
    return [SimRequest(0.0, 12, 3, blocks=first), SimRequest(0.1, 12, 3, blocks=other),
            SimRequest(0.2, 20, 3, blocks=second, after=0)]


def test_a_later_turn_is_sent_when_the_one_before_has_finished() -> None:
    first, other, turn = conversation()
    early = replace(turn, send_s=0.01)  # due before the first turn can have finished
    results = Fleet(disaggregated("precise"), profile()).run([first, other, early])
    assert results[2].sent_s == pytest.approx(results[0].end_s)
    assert results[2].sent_s > 0.01
    assert results[2].token_times[0] > results[2].sent_s
    # due after it: sent at its own time
    results = Fleet(disaggregated("precise"), profile()).run([first, other,
                                                              replace(turn, send_s=5.0)])
    assert results[0].end_s < 5.0 and results[2].sent_s == 5.0
    with pytest.raises(ValueError, match="earlier request"):
        Fleet(disaggregated("precise"), profile()).run([SimRequest(0.0, 4, 1, after=0)])


def test_round_robin_finds_a_prefix_only_on_the_worker_that_holds_it() -> None:
    # requests 0 and 2 go to prefill worker 0 in turn, request 1 to worker 1: the
    # later turn lands where its prefix is; with a request fewer in between it would not
    rr = Fleet(disaggregated("round_robin"), profile())
    rr.run(conversation())
    assert rr.prefills[0].cached_tokens == 12 and rr.computed_tokens == 12 + 12 + 8 + 3
    reqs = conversation()
    missed = Fleet(disaggregated("round_robin"), profile())
    missed.run([reqs[0], SimRequest(0.2, 20, 3, blocks=reqs[2].blocks, after=0)])
    assert missed.prefills[1].cached_tokens == 0 and missed.computed_tokens == 12 + 20 + 2


@pytest.mark.parametrize("routing", ["approximate", "precise"])
def test_an_index_sends_a_later_turn_to_the_prefix_holder(routing: str) -> None:
    reqs = conversation()
    fleet = Fleet(disaggregated(routing), profile())
    fleet.run([reqs[0], SimRequest(0.2, 20, 3, blocks=reqs[2].blocks, after=0)])
    assert fleet.computed_tokens == 12 + 8 + 2  # prompts, and one token again per decode


def test_only_precise_leaves_the_decode_workers_blocks_out_of_the_transfer() -> None:
    reqs = conversation()
    shipped = {}
    for routing in ("approximate", "precise"):
        fleet = Fleet(disaggregated(routing), profile())
        fleet.run([reqs[0], SimRequest(0.2, 20, 3, blocks=reqs[2].blocks, after=0)])
        shipped[routing] = fleet.shipped_bytes
    assert shipped["approximate"] == (12 + 20) * 1000
    assert shipped["precise"] == (12 + 8) * 1000  # the decode worker held three blocks


def test_the_router_model_answers_with_the_routers_own_policy() -> None:
    idle = EngineLoad(0, 0, 0, 0.0)
    router = RouterModel("precise", max_num_seqs=4, local_prefill_max_tokens=16)
    # precise: queue + uncached prompt per prefill worker (50 + 32 against 0 + 128), and
    # the decode worker holding 64 tokens takes fewer over (nothing cross-host here)
    holder = EngineLoad(0, 1, 50, 0.1)
    route = router.choose(128, [idle, holder], [idle, idle], {0: 0, 1: 96}, {1: 64})
    assert route == Route(1, 1, 64)
    # the same hits behind a long queue lose to the idle worker
    swamped = EngineLoad(0, 1, 300, 0.1)
    assert router.choose(128, [idle, swamped], [idle, idle], {1: 96}, {}) == Route(0, 0, 0)
    assert router.choose(10, [idle, idle], [idle, idle], {}, {}) == Route(None, 0)  # short
    full = EngineLoad(4, 0, 0, 0.0)
    assert router.choose(128, [idle], [full], {}, {}) is None  # no decode room: rejected
    rr = RouterModel("round_robin", max_num_seqs=4)
    picks = [rr.choose(128, [idle, idle], [idle, idle], {}, {}) for _ in range(3)]
    assert [(r.prefill, r.decode) for r in picks if r] == [(0, 0), (1, 1), (0, 0)]
    with pytest.raises(ValueError, match="unknown routing"):
        RouterModel("nearest", 4)
