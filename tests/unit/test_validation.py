"""Request validation: pure logic, no engine."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import generate_pb2 as pb
from services.api import validation as v

LIMITS = v.Limits(served_model="m", max_model_len=100, vocab_size=50)


def sampling(**kw: object) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)  # type: ignore[arg-type]


def test_model_name() -> None:
    v.check_model("", LIMITS)
    v.check_model("m", LIMITS)
    with pytest.raises(v.RequestError) as e:
        v.check_model("other", LIMITS)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "'m'" in e.value.message


def test_inputs() -> None:
    assert v.check_input(pb.GenerateRequest(text="hi"), LIMITS).text == "hi"
    req = pb.GenerateRequest()
    req.token_ids.ids.extend([0, 49])
    assert v.check_input(req, LIMITS).token_ids == (0, 49)
    req.token_ids.ids.append(50)
    with pytest.raises(v.RequestError, match=r"token_ids.ids\[2\]: 50"):
        v.check_input(req, LIMITS)
    chat = pb.GenerateRequest()
    chat.chat.messages.add(role="", content="x")
    with pytest.raises(v.RequestError, match=r"messages\[0\].role"):
        v.check_input(chat, LIMITS)


@pytest.mark.parametrize(("fields", "needle"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": [""]}, "stop[0]"),
    ({"stop_token_ids": [99]}, "stop_token_ids[0]"),
    ({"logprobs": 21}, "logprobs"),
])
def test_sampling_rejections(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(v.RequestError) as e:
        v.sampling_kwargs(sampling(**fields), LIMITS)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.message


def test_sampling_accepts_boundaries() -> None:
    kw = v.sampling_kwargs(sampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0,
                                    stop=["a"] * 16, seed=3, logprobs=0), LIMITS)
    assert kw["temperature"] == 0.0 and kw["top_k"] == 0 and kw["seed"] == 3
    assert v.sampling_kwargs(sampling(), LIMITS) == {}


def test_max_tokens_against_context() -> None:
    assert v.resolve_max_tokens(sampling(), 40, LIMITS) == 60
    assert v.resolve_max_tokens(sampling(max_tokens=60), 40, LIMITS) == 60
    for bad, needle in ((61, "at most 60"), (0, ">= 1"), (-3, ">= 1")):
        with pytest.raises(v.RequestError, match=needle):
            v.resolve_max_tokens(sampling(max_tokens=bad), 40, LIMITS)
    with pytest.raises(v.RequestError, match="prompt: 100 tokens"):
        v.resolve_max_tokens(sampling(), 100, LIMITS)
    with pytest.raises(v.RequestError, match="min_tokens"):
        v.resolve_max_tokens(sampling(max_tokens=5, min_tokens=6), 10, LIMITS)
