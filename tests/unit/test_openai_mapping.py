"""The OpenAI HTTP front without an engine: request bodies -> GenerateRequest, error
renaming and statuses, response and chunk shapes, over a scripted backend in-process."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from services.api.models import ServedModel
from services.api.openai_http import create_app
from services.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    openai_error,
)
from services.api.validation import invalid
from services.engine.engine import ModelFacts
from services.errors import (
    Aborted,
    DeadlineExceeded,
    FailedCall,
    ModelNotFound,
    Overloaded,
    PdserveError,
    Unavailable,
    WorkerFailure,
)
from services.messages import Delta, GenerationRequest, Timings, TokenLogprob

FACTS = ModelFacts(name="m", path=Path("m"), max_model_len=64, vocab_size=200,
                   eos_token_ids=(0,), bos_token_id=None, has_chat_template=True,
                   tokenizer_class="Fake", dtype="float32")


class FakeTokenizer:
    """One token per character (code point mod 200)."""

    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 200 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                            tokenize: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class ScriptedBackend:
    """A fake backend: answers every request with `script`, deltas or an error to raise
    there."""

    mode = "colocated"

    def __init__(self, script: list[Delta | PdserveError]) -> None:
        self.script = script
        self.requests: list[GenerationRequest] = []
        self.facts = FACTS
        self.tokenizer = FakeTokenizer()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        self.requests.append(req)
        for step in self.script:
            if isinstance(step, PdserveError):
                raise step
            yield step

    def adapter_paths(self) -> dict[str, str]:
        return {}  # no LoRA adapters

    def served_models(self) -> list[ServedModel]:
        return [ServedModel(self.facts, self.tokenizer)]  # type: ignore[arg-type]


def _answer(logprobs: bool = False) -> list[Delta | PdserveError]:
    lps = [TokenLogprob(72, -0.1, [(72, -0.1), (73, -2.5)]),
           TokenLogprob(105, -0.2, [(105, -0.2), (106, -3.0)])]
    return [Delta([72, 105], "Hi", logprobs=lps if logprobs else None),
            Delta([33], "!", logprobs=[TokenLogprob(33, float("-inf"), [])] if logprobs else None,
                  finished=True, finish_reason="stop", num_cached_tokens=2,
                  timings=Timings(queue_s=0.001, prefill_s=0.01, decode_s=0.02))]


async def post(backend: ScriptedBackend, path: str, body: dict[str, Any],
               **kw: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=create_app(backend))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(path, json=body, **kw)


def events(resp: httpx.Response) -> list[Any]:
    lines = [ln.removeprefix("data: ") for ln in resp.text.split("\n\n") if ln]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


# -- request mapping --------------------------------------------------------------------
def test_completion_prompt_forms_and_sampling() -> None:
    req = completion_request(CompletionRequest(prompt="Hello", temperature=0, stop="x", seed=3,
                                               top_k=-1, user="u", logit_bias={}), "r1")
    assert req.text == "Hello" and req.request_id == "r1"
    s = req.sampling
    assert s.temperature == 0 and list(s.stop) == ["x"] and s.seed == 3 and s.top_k == -1
    assert s.max_tokens == 16 and not s.HasField("logprobs")  # OpenAI's completions default
    assert list(completion_request(CompletionRequest(prompt=[5, 6]), "r").token_ids.ids) == [5, 6]
    assert completion_request(CompletionRequest(prompt=["one"]), "r").text == "one"
    assert list(completion_request(CompletionRequest(prompt=[[7]]), "r").token_ids.ids) == [7]
    empty = completion_request(CompletionRequest(prompt=[]), "r")
    assert empty.WhichOneof("input") == "token_ids"
    unbounded = completion_request(CompletionRequest(prompt="x", max_tokens=None), "r")
    assert not unbounded.sampling.HasField("max_tokens")


def test_chat_mapping() -> None:
    body = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None}],
        max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=2)
    req = chat_request(body, "r")
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "Be brief."), ("user", "Hi there"), ("assistant", "")]
    assert req.sampling.max_tokens == 9 and req.sampling.logprobs == 2
    plain = chat_request(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]), "r")
    assert not plain.sampling.HasField("max_tokens") and not plain.sampling.HasField("logprobs")


@pytest.mark.parametrize(("body", "needle"), [
    ({"prompt": ["a", "b"]}, "prompt: 2 prompts"),
    ({"prompt": "a", "n": -1}, "n: -1 is out of range"),
    ({"prompt": "a", "best_of": 3}, "best_of: not supported"),
    ({"prompt": "a", "suffix": "!"}, "suffix: not supported"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo: with logprobs"),
    ({"prompt": "a", "seed": -1}, "seed: -1 is out of range"),
    ({"prompt": "a", "max_tokens": 2**40}, "max_tokens: 1099511627776 is out of range"),
    ({"prompt": [1, 2**33]}, "prompt[1]:"),
])
def test_completion_refusals(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(PdserveError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        completion_request(CompletionRequest(**body), "r")


@pytest.mark.parametrize(("body", "needle"), [
    ({"top_logprobs": 2}, "top_logprobs: needs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]: only text parts"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type: 'structural_tag'"),
])
def test_chat_refusals(body: dict[str, Any], needle: str) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], **body}
    with pytest.raises(PdserveError) as err:
        chat_request(ChatCompletionRequest(**body), "r")
    assert err.value.message.startswith(needle)
    chat_request(ChatCompletionRequest(**{**body, "response_format": {"type": "text"},
                                          "top_logprobs": None,
                                          "messages": [{"role": "user", "content": "x"}]}), "r")


@pytest.mark.parametrize(("message", "chat", "expected", "param"), [
    ("sampling.top_p: 1.5 must be in (0, 1]", False, "top_p: 1.5 must be in (0, 1]", "top_p"),
    ("token_ids.ids[2]: 999 is outside", False, "prompt[2]: 999 is outside", "prompt[2]"),
    ("text: the prompt is empty", False, "prompt: the prompt is empty", "prompt"),
    ("chat.messages[0].role: empty", True, "messages[0].role: empty", "messages[0].role"),
    ("chat: the template refused", True, "messages: the template refused", "messages"),
    ("prompt: 3000 tokens leave no room", True, "messages: 3000 tokens leave no room",
     "messages"),
    ("sampling.logprobs: 30 must be in [0, 20]", True, "top_logprobs: 30 must be in [0, 20]",
     "top_logprobs"),
    ("sampling.stop[1]: must have", False, "stop[1]: must have", "stop[1]"),
    ("the engine is not running", False, "the engine is not running", None),
])
def test_error_names_the_http_field(message: str, chat: bool, expected: str,
                                    param: str | None) -> None:
    status, body = openai_error(invalid(message), chat)
    assert status == 400
    assert body == {"error": {"message": expected, "type": "BadRequestError", "param": param,
                              "code": 400}}


WORKER_GONE = WorkerFailure(FailedCall("decode", "d-0", grpc.StatusCode.UNAVAILABLE, "gone"))


@pytest.mark.parametrize(("err", "status", "kind"), [
    (ModelNotFound("x"), 404, "NotFoundError"),
    (Overloaded("x"), 429, "RateLimitError"),
    (Unavailable("x"), 503, "ServiceUnavailableError"),
    (WORKER_GONE, 503, "ServiceUnavailableError"),
    (DeadlineExceeded("x"), 504, "GatewayTimeoutError"),
    (Aborted("x"), 500, "InternalServerError"),
    (PdserveError("x"), 500, "InternalServerError"),
    (RuntimeError("a bug"), 500, "InternalServerError"),
])
def test_status_mapping(err: BaseException, status: int, kind: str) -> None:
    got, body = openai_error(err, chat=False)
    assert (got, body["error"]["type"], body["error"]["code"]) == (status, kind, status)


# -- responses ----------------------------------------------------------------------------
async def test_completion_response_and_timings_header() -> None:
    backend = ScriptedBackend(_answer())
    resp = await post(backend, "/v1/completions", {"prompt": "Hey", "max_tokens": 3},
                      headers={"X-Request-Id": "abc"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion"
    assert body["model"] == "m" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "Hi!", "logprobs": None,
                                "finish_reason": "stop", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    timings = json.loads(resp.headers["x-pdserve-timings"])
    assert body["pdserve"]["timings"] == timings
    assert timings["prefill_s"] == 0.01 and 0 < timings["ttft_s"] <= timings["e2e_s"]
    assert backend.requests[0].client_request_id == "abc"  # echoed; ours is unique
    assert backend.requests[0].request_id != "abc"
    assert backend.requests[0].prompt_token_ids == FakeTokenizer().encode("Hey")


async def test_completion_stream_with_usage() -> None:
    resp = await post(ScriptedBackend(_answer()), "/v1/completions",
                      {"prompt": "Hey", "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    chunks = events(resp)
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hi", "!"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "stop"]
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert "e2e_s" in last["pdserve"]["timings"]
    assert len({c["id"] for c in chunks}) == 1


async def test_chat_stream_and_response() -> None:
    resp = await post(ScriptedBackend(_answer()), "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "Hey"}], "stream": True})
    chunks = events(resp)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hi!"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "timings" in chunks[-1]["pdserve"]  # no usage chunk asked: on the last one
    assert chunks[0]["id"].startswith("chatcmpl-")
    body = (await post(ScriptedBackend(_answer()), "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hey"}]})).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}


async def test_logprobs_shapes() -> None:
    body = (await post(ScriptedBackend(_answer(logprobs=True)), "/v1/completions",
                       {"prompt": "Hey", "logprobs": 1})).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "i", "!"] and lp["text_offset"] == [0, 1, 2]
    assert lp["token_logprobs"] == [-0.1, -0.2, -9999.0]  # -inf is not JSON
    assert lp["top_logprobs"][0] == {"H": -0.1, "I": -2.5}
    chat = (await post(ScriptedBackend(_answer(logprobs=True)), "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hey"}], "logprobs": True,
                        "top_logprobs": 1})).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "H", "logprob": -0.1, "bytes": [72],
                          "top_logprobs": [{"token": "H", "logprob": -0.1, "bytes": [72]}]}
    assert len(content) == 3


# -- errors -------------------------------------------------------------------------------
def _check_error(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    return error


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 500}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "n": 17}, 400, "n"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, 400,
     "messages[0].role"),
])
async def test_refusals_are_openai_errors(path: str, body: dict[str, Any], status: int,
                                          param: str) -> None:
    backend = ScriptedBackend(_answer())
    error = _check_error(await post(backend, path, body), status, param)
    assert error["message"].startswith(param)
    assert not backend.requests  # refused before reaching the backend


async def test_malformed_json_and_unknown_route() -> None:
    transport = httpx.ASGITransport(app=create_app(ScriptedBackend([])))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        bad = await client.post("/v1/completions", content=b"{nope",
                                headers={"Content-Type": "application/json"})
        _check_error(bad, 400, None)
        _check_error(await client.get("/v1/nothing"), 404, None)
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("err", "status"), [
    (Overloaded("prefill worker: busy", 1500), 429), (Unavailable("prefill worker: busy"), 503),
    (DeadlineExceeded("prefill worker: busy"), 504), (PdserveError("prefill worker: busy"), 500),
])
async def test_backend_refusal_gets_http_status(err: PdserveError, status: int,
                                                stream: bool) -> None:
    backend = ScriptedBackend([err])
    resp = await post(backend, "/v1/completions", {"prompt": "hi", "stream": stream})
    error = _check_error(resp, status, None)
    assert error["message"] == err.message
    assert resp.headers.get("Retry-After") == ("2" if status == 429 else None)


async def test_error_after_first_token_is_an_event() -> None:
    backend = ScriptedBackend([Delta([72], "H"),
                               WORKER_GONE])
    resp = await post(backend, "/v1/completions", {"prompt": "hi", "stream": True})
    assert resp.status_code == 200
    chunks = events(resp)
    assert chunks[0]["choices"][0]["text"] == "H"
    assert chunks[-1]["error"]["code"] == 503


async def test_engine_failures_map_like_grpc() -> None:
    class Broken(ScriptedBackend):
        async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
            raise RuntimeError("a bug")
            yield  # pragma: no cover

    _check_error(await post(Broken([]), "/v1/completions", {"prompt": "hi"}), 500, None)
    stopped = ScriptedBackend([Delta([72], "H")])  # the stream ends unfinished: aborted
    _check_error(await post(stopped, "/v1/completions", {"prompt": "hi"}), 500, None)
