"""`pdserve up` serving two models in one stack, on a real local Ray cluster with its
own redis-server and real vLLM workers: the default model (`--model` and the stack's
pool sizes) and a tiny random-weight Llama the test creates (`--add-model`), one
prefill and one decode worker each. Each model answers as its own offline vLLM run
does, on the workers of that model only; both APIs list both models; a model the stack
does not serve is NOT_FOUND, naming those it does."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest

from services.api.client import PdserveClient
from services.registry.records import WorkerRecord
from tests.helpers.servers import free_port, scrape
from tests.helpers.tiny_llama import make_tiny_llama
from tests.integration.test_launcher import Up

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TINY = "tiny-llama"
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models-tiny") / "model", model_path)


@pytest.fixture(scope="module")
def references(model_path: Path, tiny_model: Path,
               tmp_path_factory: pytest.TempPathFactory) -> dict[Path, list[list[int]]]:
    """Each model's greedy tokens for PROMPTS from vLLM's offline `LLM.generate`, run
    before the stack starts (each in its own process, both at once)."""
    work = tmp_path_factory.mktemp("models-reference")
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    runs = {}
    for i, model in enumerate((model_path, tiny_model)):
        out, log = work / f"{i}.json", work / f"{i}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.offline_reference", str(model),
             str(prompts), str(out), str(MAX_TOKENS)],
            stdout=log.open("wb"), stderr=subprocess.STDOUT)
        runs[model] = (proc, out, log)
    found = {}
    for model, (proc, out, log) in runs.items():
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        found[model] = [r["token_ids"] for r in json.loads(out.read_text())]
    return found


class ModelsUp(Up):
    http_port: int


@pytest.fixture(scope="module")
async def up(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
             references: object) -> AsyncIterator[ModelsUp]:
    http_port = free_port()
    stack = ModelsUp(tmp_path_factory.mktemp("models-up"), "--max-model-len", "512",
                     "--http-port", str(http_port), "--add-model",
                     f"model={tiny_model},name={TINY},prefill=1,decode=1,max_model_len=256")
    stack.http_port = http_port
    async with stack.serving(4) as running:
        yield running


@pytest.fixture(scope="module")
def default_name(model_path: Path) -> str:
    return model_path.name  # the folder's name: no --served-model-name given


async def test_each_model_answers_as_its_offline_run(
        up: ModelsUp, references: dict[Path, list[list[int]]], model_path: Path,
        tiny_model: Path, default_name: str) -> None:
    async with PdserveClient(f"127.0.0.1:{up.port}") as client:
        for name, model in ((default_name, model_path), (TINY, tiny_model), ("", model_path)):
            for prompt, want in zip(PROMPTS, references[model], strict=True):
                got = await client.generate(text=prompt, model=name, temperature=0.0,
                                            max_tokens=MAX_TOKENS, timeout=120)
                assert got.token_ids == want, (name or "(no model: the default)", prompt)
    # The two models really differ: had one pool served both, one comparison would fail.
    assert references[model_path] != references[tiny_model]


async def _served_tokens(up: ModelsUp) -> dict[str, tuple[str, float]]:
    """worker id -> (its model, prompt + generated tokens its engine has served)."""
    out = {}
    for r in await up.records():
        host, _, port = r.metrics_address.rpartition(":")
        seen = scrape(int(port), host)
        out[r.worker_id] = (r.model, seen.get("vllm:prompt_tokens_total", 0.0)
                            + seen.get("vllm:generation_tokens_total", 0.0))
    return out


async def test_requests_run_on_the_workers_of_the_model_they_name(
        up: ModelsUp, default_name: str) -> None:
    records: list[WorkerRecord] = await up.records()
    assert sorted((r.worker_id, r.role, r.model) for r in records) == [
        ("decode-0", "decode", default_name), ("m1-decode-0", "decode", TINY),
        ("m1-prefill-0", "prefill", TINY), ("prefill-0", "prefill", default_name)]
    for name in (TINY, default_name):
        before = await _served_tokens(up)
        async with PdserveClient(f"127.0.0.1:{up.port}") as client:
            await asyncio.gather(*(
                client.generate(text=f"{i}: tell me about {name}", model=name,
                                temperature=0.0, max_tokens=4, ignore_eos=True, timeout=120)
                for i in range(3)))
        after = await _served_tokens(up)
        for worker, (model, served) in after.items():
            grew = served > before[worker][1]
            # Both workers of the named model served (prefill, then decode); the other
            # model's workers served nothing.
            assert grew == (model == name), (name, worker, before[worker], served)


async def test_both_apis_list_both_models(up: ModelsUp, default_name: str) -> None:
    async with PdserveClient(f"127.0.0.1:{up.port}") as client:
        info = await client.model_info()
    assert [m.model for m in info.models] == [default_name, TINY]
    assert info.model == default_name  # the one-model fields: the default model's
    assert info.serving_mode == "disaggregated"
    by_name = {m.model: m for m in info.models}
    assert by_name[TINY].max_model_len == 256 and by_name[default_name].max_model_len == 512
    assert info.max_model_len == 512
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{up.http_port}") as http:
        listed = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"], m["max_model_len"]) for m in listed] == [
            (default_name, None, 512), (TINY, None, 256)]
        answer = await http.post("/v1/completions", json={
            "model": TINY, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0})
        assert answer.status_code == 200 and answer.json()["model"] == TINY


async def test_a_model_not_served_is_not_found_naming_those_that_are(
        up: ModelsUp, default_name: str) -> None:
    async with PdserveClient(f"127.0.0.1:{up.port}") as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(text="Hello", model="gpt-4", max_tokens=2, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert default_name in (err.value.details() or "") and TINY in (err.value.details() or "")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{up.http_port}") as http:
        answer = await http.post("/v1/chat/completions", json={
            "model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 404
    message = answer.json()["error"]["message"]
    assert "'gpt-4'" in message and default_name in message and TINY in message
