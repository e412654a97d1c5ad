"""Workers of different tensor-parallel sizes in whole stacks, on the tiny random-weight
Llama of `test_tensor_parallel.py`: `pdserve up` pairs a prefill worker at TP=1 with a
decode worker at TP=2 through the registry (its record lists a KV receiver per rank); and
when the decode worker of a (2, 1) pair is killed mid-answer, its streams move to the
prefill worker, an engine of another TP size, and end as the colocated engine's.

The reference tokens come from a colocated TP=1 engine that is stopped before any stack
starts: each stack runs three ranks of its own with a KV cache each, and vLLM's CPU
backend refuses to start an engine whose KV cache the machine's free memory cannot hold,
so the stacks run one at a time with nothing else beside them."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.helpers.prompts import prompt_of_length
from tests.helpers.servers import DisaggStack
from tests.helpers.streams import streams_through
from tests.integration.test_failover_local import listener_pid
from tests.integration.test_launcher import Up
from tests.integration.test_tensor_parallel import (
    NEAR_TIE,
    PROMPTS,
    SHIPPED,
    assert_same_greedy,
    colocated,
    greedy_final,
    tiny_model,  # noqa: F401  (a fixture)
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

Greedy = list[tuple[int, list[float]]]
MOVED_TOKENS = 40  # the killed pair's answers: long enough to be cut mid-stream


def moved_prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [prompt_of_length(tokenizer, n, salt=f"tp crash {n}") for n in (50, 300)]


@pytest.fixture(scope="module")
async def references(tiny_model: Path, tokenizer,  # type: ignore[no-untyped-def]  # noqa: F811
                     tmp_path_factory: pytest.TempPathFactory) -> dict[str, Greedy]:
    """The colocated TP=1 engine's greedy tokens (with their top-2 log-probabilities) for
    every prompt of this module, by prompt; the engine is stopped before this returns."""
    server = colocated(tiny_model, tmp_path_factory.mktemp("tp-ref") / "tp1.log", 1, "1")
    async with server.running(timeout=600):
        out = {prompt: (await greedy_final(server, prompt))[0] for prompt in PROMPTS}
        for ids in moved_prompts(tokenizer):
            out[str(ids)] = (await greedy_final(server, ids, MOVED_TOKENS))[0]
    return out


@pytest.fixture
async def up_stack(references: dict[str, Greedy], tiny_model: Path,  # noqa: F811
                   tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Up]:
    """`pdserve up` (Ray, redis-server, the workers as actors) with a prefill worker at
    TP=1 and a decode worker at TP=2, each on its own core."""
    stack = Up(tmp_path_factory.mktemp("tp-up"), "--model", str(tiny_model),
               "--max-model-len", "512", "--prefill-tp", "1", "--decode-tp", "2",
               "--kv-load-failure-policy", "fail")
    async with stack.serving() as running:
        yield running


async def test_up_pairs_workers_of_different_tp_sizes_through_the_registry(
        references: dict[str, Greedy], up_stack: Up) -> None:
    """The decode worker's record names a KV receiver per rank; the router hands them to
    the prefill worker, whose one rank ships each decode rank its head: the colocated
    tokens, from KV loaded whole."""
    records = {r.role: r for r in await up_stack.records()}
    decode, prefill = records["decode"], records["prefill"]
    assert (decode.tp, decode.kv_heads, len(decode.kv_addresses)) == (2, 1, 2)
    assert decode.kv_addresses[0] == decode.kv_address
    assert (prefill.tp, prefill.kv_heads, prefill.kv_addresses) == (1, 2, ())
    assert prefill.fingerprint == decode.fingerprint  # the model's layout, not a rank's
    for prompt in PROMPTS:
        got, final = await greedy_final(f"127.0.0.1:{up_stack.port}", prompt)
        assert_same_greedy(references[prompt], got, f"up 1->2, {prompt!r}")
        shipped = final.timings.kv_transfer_bytes
        assert shipped > 0 and final.timings.kv_prompt_bytes == shipped, final
        # The same bytes as every pair of `test_tensor_parallel.py` moved, when it ran first.
        assert SHIPPED.setdefault(prompt, shipped) == shipped, (prompt, SHIPPED, shipped)


@pytest.fixture
async def killable(references: dict[str, Greedy], tiny_model: Path,  # noqa: F811
                   tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[DisaggStack]:
    """A pair of its own (the test kills its decode worker): prefill at TP=2, decode at
    TP=1."""
    stack = DisaggStack.create(tmp_path_factory.mktemp("tp-kill") / "disagg.log", "grpc",
                               "--model", str(tiny_model), "--max-model-len", "512",
                               "--prefill-tp", "2", "--decode-tp", "1")
    async with stack.server.running(timeout=600):
        yield stack


async def test_a_killed_decode_worker_moves_its_streams_to_a_worker_of_another_tp_size(
        references: dict[str, Greedy], killable: DisaggStack, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The decode worker (TP=1) is SIGKILLed mid-answer: every stream moves to the prefill
    worker (a full engine at TP=2) and ends with the colocated TP=1 engine's tokens (a
    flip only at a near-tie)."""
    prompts = moved_prompts(tokenizer)
    decode_pid = listener_pid(killable.decode_port)
    results = await streams_through(killable.server, prompts, MOVED_TOKENS,
                                    lambda: os.killpg(decode_pid, signal.SIGKILL))
    for ids, (tokens, moved) in zip(prompts, results, strict=True):
        assert moved >= 1
        want = references[str(ids)]
        want_tokens = [t for t, _ in want]
        if tokens == want_tokens:
            continue
        first = next(i for i, (a, b) in enumerate(zip(tokens, want_tokens, strict=True))
                     if a != b)
        top = want[first][1]
        print(f"moved stream: tokens differ from position {first}; top-2 gap there "
              f"{top[0] - top[1]:.2e}")
        assert top[0] - top[1] < NEAR_TIE
