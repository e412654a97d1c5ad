"""Request validation: pure logic, no engine."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import generate_pb2 as pb
from services import limits
from services.api import validation as v
from services.errors import InvalidRequest, ModelNotFound, PdserveError

LIMITS = limits.Limits(served_model="m", max_model_len=100, vocab_size=50)


def sampling(**kw: object) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)  # type: ignore[arg-type]


def test_model_name() -> None:
    v.check_model("", LIMITS)
    v.check_model("m", LIMITS)
    with pytest.raises(ModelNotFound) as e:
        v.check_model("other", LIMITS)
    assert e.value.status == grpc.StatusCode.NOT_FOUND and "'m'" in e.value.message


def test_inputs() -> None:
    assert v.check_input(pb.GenerateRequest(text="hi"), LIMITS).text == "hi"
    req = pb.GenerateRequest()
    req.token_ids.ids.extend([0, 49])
    assert v.check_input(req, LIMITS).token_ids == (0, 49)
    req.token_ids.ids.append(50)
    with pytest.raises(InvalidRequest, match=r"token_ids.ids\[2\]: 50"):
        v.check_input(req, LIMITS)
    chat = pb.GenerateRequest()
    chat.chat.messages.add(role="", content="x")
    with pytest.raises(InvalidRequest, match=r"messages\[0\].role"):
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
    # vLLM's own limits, refused here rather than by the engine (a worker failure)
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 1e30}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"seed": 2**63}, "seed"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": [""]}, "stop[0]"),
    ({"stop_token_ids": [99]}, "stop_token_ids[0]"),
    ({"logprobs": 21}, "logprobs"),
])
def test_sampling_rejections(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        limits.check_sampling(sampling(**fields), LIMITS)
    assert e.value.status == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.message


def test_sampling_accepts_boundaries() -> None:
    kw = limits.check_sampling(sampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0,
                                   stop=["a"] * 16, seed=3, logprobs=0), LIMITS).vllm_kwargs()
    assert kw["temperature"] == 0.0 and kw["top_k"] == 0 and kw["seed"] == 3
    assert kw["stop"] == ["a"] * 16 and kw["logprobs"] == 0
    assert limits.check_sampling(sampling(temperature=2.0), LIMITS).temperature == 2.0
    assert limits.check_sampling(sampling(), LIMITS).vllm_kwargs() == {}


def test_every_client_error_is_a_client_error() -> None:
    """What validation raises is never mistaken for a worker's failure."""
    from services.errors import ClientError

    with pytest.raises(PdserveError) as e:
        limits.check_sampling(sampling(temperature=float("inf")), LIMITS)
    assert isinstance(e.value, ClientError)


def resolved(s: pb.SamplingParams, prompt_len: int) -> int:
    return limits.resolve_max_tokens(limits.check_sampling(s, LIMITS), prompt_len, LIMITS)


def test_max_tokens_against_context() -> None:
    assert resolved(sampling(), 40) == 60
    assert resolved(sampling(max_tokens=60), 40) == 60
    for bad, needle in ((61, "at most 60"), (0, ">= 1"), (-3, ">= 1")):
        with pytest.raises(InvalidRequest, match=needle):
            resolved(sampling(max_tokens=bad), 40)
    with pytest.raises(InvalidRequest, match="prompt: 100 tokens"):
        resolved(sampling(), 100)
    with pytest.raises(InvalidRequest, match="min_tokens"):
        resolved(sampling(max_tokens=5, min_tokens=6), 10)
    with pytest.raises(InvalidRequest, match="min_tokens: 70 is more than the 60 tokens"):
        resolved(sampling(min_tokens=70), 40)
