"""The OpenAI-compatible HTTP API of a real colocated server, driven by the real `openai`
client (sync and async, streaming and not) and raw HTTP: the same greedy answers as the
gRPC API, OpenAI's response and error shapes, and aborts when the client goes away."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.api.client import PdserveClient
from tests.helpers.prompts import TEXT_PROMPTS
from tests.helpers.servers import ServerProcess

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct-float32"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LONG = {"prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module")
async def http(colocated: ServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=colocated.base_url.removesuffix("/v1"),
                                 timeout=60) as client:
        yield client


def sync_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def async_client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


async def test_completions_equal_grpc(colocated: ServerProcess, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("Count: one, two, three, four,")
    async with PdserveClient(colocated.target) as grpc_client, async_client(colocated) as client:
        for prompt in [*TEXT_PROMPTS[:3], ids]:
            kw: dict[str, Any] = {"token_ids": ids} if prompt is ids else {"text": prompt}
            expected = await grpc_client.generate(**kw, temperature=0.0, max_tokens=24)
            got = await client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                  max_tokens=24)
            assert got.choices[0].text == expected.text
            assert got.choices[0].finish_reason == expected.finish_reason
            assert got.usage is not None
            assert got.usage.completion_tokens == expected.completion_tokens
            assert got.usage.prompt_tokens == expected.prompt_tokens
            assert got.id.startswith("cmpl-") and got.model == MODEL


async def test_chat_equals_grpc_and_streams_the_same(colocated: ServerProcess) -> None:
    async with PdserveClient(colocated.target) as grpc_client, async_client(colocated) as client:
        expected = await grpc_client.generate(chat=[("user", CHAT[0]["content"])],
                                              temperature=0.0, max_tokens=32)
        got = await client.chat.completions.create(model=MODEL, messages=CHAT,  # type: ignore[arg-type]
                                                   temperature=0, max_completion_tokens=32)
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_tokens=32, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    assert "Paris" in expected.text
    assert got.choices[0].message.content == expected.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage is not None and got.usage.completion_tokens == expected.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == expected.completion_tokens
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason
    timings = (chunks[-1].model_extra or {})["pdserve"]["timings"]
    assert 0 < timings["ttft_s"] <= timings["e2e_s"] and timings["prefill_s"] > 0


def test_sync_client_stream_and_timings(colocated: ServerProcess) -> None:
    with sync_client(colocated) as client:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt="List five fruits:", temperature=0, max_tokens=20)
        whole = raw.parse()
        pieces = list(client.completions.create(
            model=MODEL, prompt="List five fruits:", temperature=0, max_tokens=20, stream=True,
            stream_options={"include_usage": True}))
    header = json.loads(raw.headers["x-pdserve-timings"])
    assert (whole.model_extra or {})["pdserve"]["timings"] == header
    assert 0 < header["ttft_s"] <= header["e2e_s"] and header["decode_s"] > 0
    assert len(pieces) > 3
    assert "".join(p.choices[0].text for p in pieces if p.choices) == whole.choices[0].text
    assert pieces[-1].usage is not None and whole.usage is not None
    assert pieces[-1].usage.completion_tokens == whole.usage.completion_tokens


async def sse_events(http: httpx.AsyncClient, path: str,
                     body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of one raw SSE stream, up to `data: [DONE]`."""
    events: list[dict[str, Any]] = []
    async with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                return events
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    raise AssertionError(f"the stream ended without data: [DONE] after {events}")


async def test_stream_usage_as_vllm_sends_it(http: httpx.AsyncClient) -> None:
    """Usage in a stream as vLLM sends it, which benchmark clients (AIPerf) read: none
    unless asked; with `include_usage` a last chunk without choices; with
    `continuous_usage_stats` as well, the tokens so far on every chunk, each chunk
    carrying one engine step's tokens or more, never none."""
    body = {**LONG, "model": MODEL, "max_tokens": 12, "stream": True}
    plain = await sse_events(http, "/v1/completions", body)
    alone = await sse_events(http, "/v1/completions",
                             {**body, "stream_options": {"continuous_usage_stats": True}})
    last_only = await sse_events(http, "/v1/completions",
                                 {**body, "stream_options": {"include_usage": True}})
    running = await sse_events(http, "/v1/completions", {**body, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    text = "".join(e["choices"][0]["text"] for e in plain)
    assert all(e["choices"] and "usage" not in e for e in [*plain, *alone])
    assert plain[-1]["choices"][0]["finish_reason"] == "length"
    for events in (last_only, running):
        *chunks, last = events
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert all("usage" not in c for c in last_only[:-1])
    prompt = running[-1]["usage"]["prompt_tokens"]
    counts = [0]
    for c in running[:-1]:
        usage = c["usage"]
        assert usage["prompt_tokens"] == prompt
        assert usage["total_tokens"] == prompt + usage["completion_tokens"]
        assert usage["completion_tokens"] > counts[-1]  # every chunk carries new tokens
        counts.append(usage["completion_tokens"])
    assert counts[-1] == 12

    chat = await sse_events(http, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[0]["usage"]["completion_tokens"] == 0  # the role comes before any token
    assert [c["usage"]["completion_tokens"] for c in chat[1:]][-2:] == [6, 6]


async def test_logprobs(colocated: ServerProcess) -> None:
    async with async_client(colocated) as client:
        comp = await client.completions.create(model=MODEL, prompt="Hello", temperature=0,
                                               max_tokens=4, logprobs=2)
        chat = await client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_tokens=4, logprobs=True,  # type: ignore[arg-type]
            top_logprobs=2)
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.tokens) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen >= max(top.values()) - 1e-5  # greedy: the most likely token
    content = (chat.choices[0].logprobs and chat.choices[0].logprobs.content) or []
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob >= entry.top_logprobs[0].logprob - 1e-5
        assert entry.bytes == list(entry.token.encode())


BAD: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 999_999]}, 400, "prompt[2]"),
    ("completions", {"prompt": [100 + i % 1000 for i in range(2100)]}, 400, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    # several answers need sampling: greedy n > 1 is refused, as vLLM refuses it
    ("completions", {"prompt": "hi", "n": 2, "temperature": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    # echo is served, but not with logprobs: those would be the prompt's too
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("completions", {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                          "model": "gpt-17"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD,
                         ids=[f"{p}-{'-'.join(b) or 'empty'}-{s}" for p, b, s, _ in BAD])
async def test_refusals_have_status_and_openai_shape(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], status: int, param: str | None,
) -> None:
    resp = await http.post(f"/v1/{path}", json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    assert error["message"].startswith(f"{param}:"), error["message"]


async def test_openai_client_raises_typed_errors(colocated: ServerProcess) -> None:
    async with async_client(colocated) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=MODEL, prompt="hi", top_p=1.5)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-17", messages=CHAT)  # type: ignore[arg-type]
        ok = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert "top_p" in bad.value.message
    assert ok.usage is not None and ok.usage.completion_tokens == 2


async def test_models_health_metrics(http: httpx.AsyncClient) -> None:
    models = (await http.get("/v1/models")).json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, 2048)]
    assert (await http.get("/health")).status_code == 200
    metrics = await http.get("/metrics")
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    assert "vllm:e2e_request_latency_seconds" in metrics.text


async def _running(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))


async def _until(http: httpx.AsyncClient, busy: bool, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (await _running(http) > 0) != busy:
        assert time.monotonic() < deadline, f"engine still {'idle' if busy else 'busy'}"
        await asyncio.sleep(0.25)


async def test_disconnect_aborts_engine_request(http: httpx.AsyncClient,
                                                colocated: ServerProcess) -> None:
    await _until(http, busy=False)
    async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
        seen = 0
        async for line in resp.aiter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break
        assert await _running(http) >= 1
    await _until(http, busy=False)  # the closed stream aborted the request

    # Not streaming: the client gives up while the answer is being generated.
    async with httpx.AsyncClient(base_url=str(http.base_url), timeout=60) as other:
        task = asyncio.create_task(other.post("/v1/completions", json=LONG))
        await _until(http, busy=True)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await _until(http, busy=False)
    assert colocated.metrics()["vllm:num_requests_running"] == 0
    ok = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.json()["usage"]["completion_tokens"] == 2


def doc_examples() -> tuple[list[str], str]:
    """The curl commands and the Python snippet of the OpenAI API page's quickstart."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "openai-api.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    # the curl block (the one before it starts the server)
    bash = next(b for b in section.split("```bash\n")[1:] if b.startswith("curl"))
    bash = bash.split("```", 1)[0]
    commands, current = [], ""
    for line in bash.splitlines():  # one command: until no `\` and no open quote
        current += line + "\n"
        if not line.endswith("\\") and current.count("'") % 2 == 0:
            if current.startswith("curl"):
                commands.append(current.strip())
            current = ""
    python = section.split("```python\n", 1)[1].split("```", 1)[0]
    return commands, python


def test_doc_examples_work_as_written(colocated: ServerProcess) -> None:
    """Every curl line and the `openai` snippet of docs/openai-api.md, pointed at a live
    server."""
    commands, python = doc_examples()
    assert len(commands) == 5, commands
    address = f"127.0.0.1:{colocated.http_port}"
    outputs = []
    for command in commands:
        run = subprocess.run(["bash", "-o", "pipefail", "-c",
                              command.replace("localhost:8000", address)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"{command}\n{run.stderr}"
        outputs.append(run.stdout)
    completion, stream, models, health, metrics = outputs
    assert json.loads(completion)["choices"][0]["text"]
    assert stream.rstrip().endswith("data: [DONE]") and '"usage"' in stream
    assert json.loads(models)["data"][0]["id"]
    assert health.startswith("HTTP/1.1 200")
    assert "vllm:num_requests_running" in metrics  # a colocated engine's
    snippet = python.replace("http://127.0.0.1:8000/v1", colocated.base_url)
    run = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
