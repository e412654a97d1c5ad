"""n > 1 without an engine: the field's checks, each choice's chunks through the wire
format, and the OpenAI answer built from interleaved choices."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.v1 import generate_pb2 as pb
from services import wire
from services.api.openai_answer import Answer
from services.errors import InvalidRequest
from services.limits import MAX_N, MAX_SEED, Limits, check_sampling
from services.messages import Delta, Sampling

LIMITS = Limits("m", 64, 200)


class FakeTokenizer:
    """Stands in for a tokenizer: token id t is the character chr(t)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(t) for t in ids)


def test_n_is_checked_and_carried() -> None:
    assert check_sampling(pb.SamplingParams(), LIMITS).n == 1
    assert check_sampling(pb.SamplingParams(n=MAX_N), LIMITS).n == MAX_N
    for bad in (pb.SamplingParams(n=0), pb.SamplingParams(n=MAX_N + 1),
                pb.SamplingParams(n=2, temperature=0.0)):  # greedy: one answer, as in vLLM
        with pytest.raises(InvalidRequest, match=r"^sampling\.n: "):
            check_sampling(bad, LIMITS)
    check_sampling(pb.SamplingParams(n=2, temperature=0.5), LIMITS)
    # choice i samples with seed + i: every child seed must be one vLLM takes
    check_sampling(pb.SamplingParams(n=3, seed=MAX_SEED - 2), LIMITS)
    with pytest.raises(InvalidRequest, match=r"^sampling\.seed: "):
        check_sampling(pb.SamplingParams(n=3, seed=MAX_SEED - 1), LIMITS)
    s = Sampling(n=4, seed=9)
    assert check_sampling(wire.sampling_pb(s, 8, 0), LIMITS) == Sampling(
        n=4, seed=9, max_tokens=8)
    assert s.vllm_kwargs()["n"] == 4
    assert "n" not in Sampling().vllm_kwargs()


def test_a_choice_chunk_round_trips_with_its_index_and_end() -> None:
    d = Delta([5, 6], "ab", index=2, choice_finish_reason="length")
    back = wire.delta_of_bytes(wire.chunk_pb(d).SerializeToString())
    assert (back.token_ids, back.text, back.index) == ([5, 6], "ab", 2)
    assert back.choice_finish_reason == "length" and not back.finished
    assert wire.is_chunk(Delta([], "", index=1, choice_finish_reason="stop"))
    assert not wire.is_chunk(Delta([], ""))
    # one answer: the chunk is what it always was
    assert wire.chunk_pb(Delta([5], "a")) == pb.GenerateResponse(
        chunk=pb.Chunk(token_ids=[5], text="a"))


def answer(n: int, chat: bool) -> Answer:
    tokenizer: Any = FakeTokenizer()
    return Answer(chat=chat, request_id="r", model="m", started=0.0, prompt_tokens=3,
                  tokenizer=tokenizer, n=n)


def test_interleaved_choices_make_one_response_per_index() -> None:
    a = answer(2, chat=True)
    streamed = [a.add(Delta([104], "h", index=1)), a.add(Delta([105], "i", index=0)),
                a.add(Delta([33], "!", index=1, choice_finish_reason="stop")),
                a.add(Delta([63], "?", index=0, choice_finish_reason="length")),
                a.add(Delta([], "", finished=True, finish_reason="length"))]
    assert [c["index"] for c in streamed if c] == [1, 0, 1, 0]
    assert streamed[2] is not None and streamed[2]["finish_reason"] == "stop"
    assert streamed[-1] is None  # the request's end: each choice ended on its own
    body = a.response()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]
            ] == [(0, "i?", "length"), (1, "h!", "stop")]
    assert body["usage"]["completion_tokens"] == 4
    assert [c["index"] for c in a.role_choices()] == [0, 1]


def test_one_choice_answer_is_unchanged() -> None:
    a = answer(1, chat=False)
    first = a.add(Delta([104], "h"))
    last = a.add(Delta([105], "i", finished=True, finish_reason="stop"))
    assert first is not None and first["finish_reason"] is None
    assert last is not None and last["finish_reason"] == "stop"
    (choice,) = a.response()["choices"]
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, "hi", "stop")
