"""The engine model against schedules worked out by hand (pure logic, no engine)."""

from __future__ import annotations

import pytest

from services.plan.costmodel import StepCost
from services.plan.engine_model import EngineLimits, EngineSim, Job

# One second per step plus 10 ms per prompt token: easy to add up by hand.
SIMPLE = StepCost(base_s=1.0, prefill_token_s=0.01, decode_seq_s=0.0, attention_s=0.0,
                  decode_context_s=0.0)


def run(engine: EngineSim, jobs: list[Job], start: float = 0.0) -> dict[int, list[float]]:
    """Steps the engine from ``start`` until it is idle; the token times of every job."""
    for job in jobs:
        engine.submit(job)
    now, times = start, {}
    while (end := engine.start_step(now)) is not None:
        now = end
        _, done = engine.finish_step()
        for job in done:
            times[job.rid] = [round(t, 9) for t in engine.token_times(job)]
    return times


def test_a_long_prompt_is_chunked_by_the_budget() -> None:
    engine = EngineSim(SIMPLE, EngineLimits(100, 4, 10_000))
    # 250 tokens at 100 per step: steps of 100, 100, 50 tokens (2, 2, 1.5 s), then the
    # first token at 5.5; two decode steps of 1 s each.
    assert run(engine, [Job(0, 250, 3)]) == {0: [5.5, 6.5, 7.5]}


def test_decoders_take_their_token_before_prefill_chunks() -> None:
    engine = EngineSim(SIMPLE, EngineLimits(100, 4, 10_000))
    times = run(engine, [Job(0, 10, 3), Job(1, 195, 2)])
    # step 0: A 10 + B 90 tokens (2.0 s) -> A's first token at 2.0
    # step 1: A decodes, B gets 99 tokens (1.99 s) -> 3.99
    # step 2: A decodes (its last), B's last 6 tokens (1.06 s) -> 5.05, B's first token
    # step 3: B decodes (1 s) -> 6.05
    assert times == {0: [2.0, 3.99, 5.05], 1: [5.05, 6.05]}


def test_max_num_seqs_holds_requests_back() -> None:
    engine = EngineSim(SIMPLE, EngineLimits(100, 2, 10_000))
    times = run(engine, [Job(0, 10, 2), Job(1, 10, 2), Job(2, 10, 1)])
    # step 0: A and B prefill (1.2 s); step 1: both decode their last token (1 s) -> 2.2;
    # only then C is admitted: step 2 prefills it (1.1 s) -> 3.3
    assert times == {0: [1.2, 2.2], 1: [1.2, 2.2], 2: [3.3]}


def test_kv_capacity_holds_requests_back() -> None:
    engine = EngineSim(SIMPLE, EngineLimits(100, 8, 100))
    times = run(engine, [Job(0, 50, 2), Job(1, 50, 2)])
    # each needs 52 tokens of KV, 100 fit one at a time: B waits for A to finish
    assert times == {0: [1.5, 2.5], 1: [4.0, 5.0]}


def test_decode_cost_grows_with_batch_and_context() -> None:
    cost = StepCost(base_s=1.0, prefill_token_s=0.0, decode_seq_s=0.5, attention_s=0.0,
                    decode_context_s=1e5)  # 0.1 s per context token read
    engine = EngineSim(cost, EngineLimits(100, 4, 10_000))
    times = run(engine, [Job(0, 4, 3)])
    # prefill step: 1 s; decode steps read 5 then 6 tokens of context: 1 + 0.5 + 0.5 = 2.0
    # then 1 + 0.5 + 0.6 = 2.1
    assert times == {0: [1.0, 3.0, 5.1]}


def test_a_shipped_request_computes_one_token_and_pays_the_handoff() -> None:
    engine = EngineSim(SIMPLE, EngineLimits(100, 4, 10_000))
    times = run(engine, [Job(0, 1, 3, context=999, handoff_s=0.25)])
    # one token with 999 of context already there: 1.01 s + 0.25 s handoff, then 2 decodes
    assert times == {0: [1.26, 2.26, 3.26]}


def test_a_shipped_request_landing_mid_step_is_loaded_in_the_next_step_then_scheduled() -> None:
    # vLLM's asynchronous KV load: found complete at a step's start, copied in during that
    # step (which pays the handoff), reported at its end, scheduled in the step after.
    engine = EngineSim(SIMPLE, EngineLimits(100, 4, 10_000))
    engine.submit(Job(0, 1, 5))
    assert engine.start_step(0.0) == pytest.approx(1.01)  # job 0's prefill, in flight
    shipped = Job(1, 1, 2, context=999, handoff_s=0.25)
    engine.submit_remote(shipped)  # lands at t=0.5, mid-step
    assert engine.requests == 2 and not engine.waiting
    engine.finish_step()
    times = run(engine, [], start=1.01)
    # step 2 (1.01-2.26) decodes job 0 and loads job 1 (+0.25 s); step 3 (2.26-3.27)
    # schedules job 1's one token; then one more decode step.
    assert times == {1: [3.27, 4.27], 0: [1.01, 2.26, 3.27, 4.27, 5.27]}


def test_an_idle_engine_schedules_a_shipped_request_at_once() -> None:
    engine = EngineSim(SIMPLE, EngineLimits(100, 4, 10_000))
    engine.submit_remote(Job(0, 1, 2, context=999, handoff_s=0.25))
    assert engine.start_step(0.0) == pytest.approx(1.26)


def test_a_request_that_can_never_fit_is_refused() -> None:
    engine = EngineSim(SIMPLE, EngineLimits(100, 4, 50))
    with pytest.raises(ValueError, match="never fit"):
        engine.submit(Job(0, 40, 20))


def test_the_router_sees_the_prompts_waiting_or_being_prefilled() -> None:
    """As a vLLM worker reports it: a prompt counts whole until its prefill is done."""
    engine = EngineSim(SIMPLE, EngineLimits(100, 4, 10_000))
    engine.submit(Job(0, 250, 1))
    assert engine.queued_tokens == 250
    end = engine.start_step(0.0)
    assert end == pytest.approx(2.0)
    engine.finish_step()
    assert engine.queued_tokens == 250
    for _ in range(2):
        engine.start_step(0.0)
        engine.finish_step()
    assert engine.queued_tokens == 0


def test_the_long_prefill_cap_lets_a_short_prompt_through_and_is_lifted_when_alone() -> None:
    capped = EngineLimits(200, 4, 10_000, long_prefill_token_threshold=50)
    # Alone, a 120-token prompt gets the whole budget (vLLM lifts the cap): one step.
    assert run(EngineSim(SIMPLE, capped), [Job(0, 120, 2)]) == {0: [2.2, 3.2]}
    # With a 30-token prompt beside it: step 0 takes 50 of the long one and the short
    # one whole (1.8 s: the short one's token); step 1 the long one's last 70, alone.
    assert run(EngineSim(SIMPLE, capped), [Job(0, 120, 1), Job(1, 30, 1)]) == \
        {0: [3.5], 1: [1.8]}
    # Without the cap both come after one 150-token step.
    assert run(EngineSim(SIMPLE, EngineLimits(200, 4, 10_000)),
               [Job(0, 120, 1), Job(1, 30, 1)]) == {0: [2.5], 1: [2.5]}
    with pytest.raises(ValueError):
        EngineLimits(200, 4, 10_000, long_prefill_token_threshold=-1)
