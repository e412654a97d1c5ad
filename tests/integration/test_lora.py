"""LoRA adapters on real engines: named at start (`--lora NAME=PATH`), loaded and
unloaded at run time (gRPC and vLLM's HTTP endpoints), used by naming them as `model`.
Through a disaggregated stack the prefill and decode workers run one request under the
same adapter, so greedy output is token-identical to colocated vLLM with that adapter
and differs from the base model's; a bad adapter folder is the client's error and the
server keeps serving. The adapters are written by the test (`tests/helpers/lora.py`)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc
from services.api.client import PdserveClient
from services.registry.redis_server import RedisServer
from services.registry.registry import Registry
from services.registry.signing import RecordSigner
from tests.helpers.lora import write_adapter
from tests.helpers.servers import DisaggStack, ServerProcess, scrape

pytestmark = pytest.mark.engine

CHATS = [
    [("user", "What is the capital of France?")],
    [("user", "Write one sentence about the sea.")],
    [("user", "List three colours.")],
]
MAX_TOKENS = 24
SECRET = "lora-tests-cluster-secret"  # the pool's: workers sign records, the router checks


@pytest.fixture(scope="module")
def adapters(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": write_adapter(root / "sql", model_path, seed=0),
            "poet": write_adapter(root / "poet", model_path, seed=1, rank=16, alpha=32),
            "too-big": write_adapter(root / "too-big", model_path, rank=32)}


@pytest.fixture(scope="module")
async def colocated_lora(adapters: dict[str, Path], session_dir: Path
                         ) -> AsyncIterator[ServerProcess]:
    server = ServerProcess(["--mode", "colocated", "--kv-cache-gib", "1",
                            "--lora", f"sql={adapters['sql']}", "--max-loras", "2"],
                           session_dir / "colocated-lora.log")
    async with server.running():
        yield server


@pytest.fixture(scope="module")
async def disagg_lora(adapters: dict[str, Path], session_dir: Path
                      ) -> AsyncIterator[DisaggStack]:
    # vLLM's spelling of the flag, as a vLLM user would write it.
    stack = DisaggStack.create(session_dir / "disagg-lora.log", "grpc",
                               "--lora-modules", f"sql={adapters['sql']}", "--max-loras", "2")
    async with stack.server.running(timeout=600):
        yield stack


@pytest.fixture(scope="module")
async def pool_lora(adapters: dict[str, Path], session_dir: Path, redis: RedisServer
                    ) -> AsyncIterator[ServerProcess]:
    """A router over Redis in front of a prefill worker that loads `sql` at start and a
    decode worker that may load adapters but has none: the router of `pdserve up`."""
    env = {"PDSERVE_CLUSTER_SECRET": SECRET}
    common = ["--redis-url", redis.url, "--kv-cache-gib", "1", "--worker-ttl-s", "3"]
    prefill = ServerProcess([*common, "--worker-id", "lora-p", "--cpu-cores", "0",
                             "--lora", f"sql={adapters['sql']}"],
                            session_dir / "lora-prefill.log", command="prefill", env=env)
    decode = ServerProcess([*common, "--worker-id", "lora-d", "--cpu-cores", "1",
                            "--enable-lora"], session_dir / "lora-decode.log",
                           command="decode", env=env)
    router = ServerProcess(["--redis-url", redis.url], session_dir / "lora-router.log",
                           command="router", env=env)
    async with prefill.running(600), decode.running(600), router.running():
        yield router


async def greedy(target: str, model: str = "", chat: list[tuple[str, str]] = CHATS[0]
                 ) -> list[int]:
    async with PdserveClient(target) as client:
        result = await client.generate(chat=chat, model=model, max_tokens=MAX_TOKENS,
                                       temperature=0.0)
    return result.token_ids


async def admin(target: str, load: tuple[str, str] | None = None,
                unload: str | None = None) -> str:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        if load is not None:
            r = await stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
                lora_name=load[0], lora_path=load[1]), timeout=120)
        else:
            r = await stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(
                lora_name=unload or ""), timeout=120)
    return str(r.message)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(f"{server.base_url}/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def test_adapter_output_matches_colocated_and_differs_from_base(
        colocated_lora: ServerProcess, disagg_lora: DisaggStack) -> None:
    differs = 0
    for chat in CHATS:
        # The base model first: its prompt blocks are then in both prefix caches, and an
        # adapter request that reused them would answer like the base model.
        base_d = await greedy(disagg_lora.server.target, "", chat)
        base_c = await greedy(colocated_lora.target, "", chat)
        sql_d = await greedy(disagg_lora.server.target, "sql", chat)
        sql_c = await greedy(colocated_lora.target, "sql", chat)
        assert base_d == base_c, chat
        assert sql_d == sql_c, chat
        differs += sql_d != base_d
    assert differs == len(CHATS)


async def test_load_at_run_time_use_unload_then_not_found(
        colocated_lora: ServerProcess, disagg_lora: DisaggStack,
        adapters: dict[str, Path]) -> None:
    path = str(adapters["poet"])
    target = disagg_lora.server.target
    before = scrape(disagg_lora.server.metrics_port, reason="admin").get(
        "pdserve_router_lora_loads_total", 0.0)
    assert "added successfully" in await admin(target, load=("poet", path))
    # Every worker loaded it: the router's counter shows one load per worker.
    after = scrape(disagg_lora.server.metrics_port, reason="admin")
    assert after["pdserve_router_lora_loads_total"] == before + 2
    async with PdserveClient(target) as client:
        info = await client.model_info()
    assert {(a.name, a.parent) for a in info.lora_adapters} == {
        ("sql", info.model), ("poet", info.model)}
    status, text = post(colocated_lora, "load_lora_adapter",
                        {"lora_name": "poet", "lora_path": path})
    assert (status, text) == (200, "Success: LoRA adapter 'poet' added successfully.")
    poet = await greedy(target, "poet", CHATS[1])
    assert poet == await greedy(colocated_lora.target, "poet", CHATS[1])
    assert poet != await greedy(target, "sql", CHATS[1])
    # A second load under a taken name is refused, as vLLM does.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin(target, load=("poet", path))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already loaded" in (err.value.details() or "")

    assert "removed successfully" in await admin(target, unload="poet")
    status, _ = post(colocated_lora, "unload_lora_adapter", {"lora_name": "poet"})
    assert status == 200
    for server in (target, colocated_lora.target):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await greedy(server, "poet")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    status, text = post(disagg_lora.server, "unload_lora_adapter", {"lora_name": "poet"})
    assert status == 404, text
    assert json.loads(text)["error"]["type"] == "NotFoundError"
    status, text = post(disagg_lora.server, "completions",
                        {"model": "poet", "prompt": "Hi", "max_tokens": 4})
    assert status == 404, text


@pytest.mark.parametrize("folder, words", [
    ("too-big", "rank 32 is above the engines' max_lora_rank 16"),
    ("missing", "is not a folder on the server"),
])
async def test_a_bad_adapter_is_400_and_serving_goes_on(
        disagg_lora: DisaggStack, adapters: dict[str, Path], folder: str, words: str) -> None:
    path = str(adapters.get(folder, adapters["sql"].parent / folder))
    status, text = post(disagg_lora.server, "load_lora_adapter",
                        {"lora_name": folder, "lora_path": path})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert words in error["message"] and error["type"] == "BadRequestError", error
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin(disagg_lora.server.target, load=(folder, path))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (err.value.details() or "")
    # Nothing was left loaded anywhere, and both the base model and the adapter serve.
    async with PdserveClient(disagg_lora.server.target) as client:
        info = await client.model_info()
    assert [a.name for a in info.lora_adapters] == ["sql"]
    assert await greedy(disagg_lora.server.target, "sql")
    assert await greedy(disagg_lora.server.target)


async def test_openai_client_names_the_adapter_as_its_model(
        disagg_lora: DisaggStack) -> None:
    import openai

    async with openai.AsyncOpenAI(base_url=disagg_lora.server.base_url, api_key="unused",
                                  max_retries=0) as client:
        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) >= {"sql"}
        base = next(name for name, m in models.items() if name != "sql")
        assert models["sql"].model_extra is not None
        assert models["sql"].model_extra["parent"] == base
        answer = await client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": CHATS[0][0][1]}],
            max_tokens=MAX_TOKENS, temperature=0.0)
        assert answer.model == "sql"
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nobody", prompt="Hi", max_tokens=4)
    async with PdserveClient(disagg_lora.server.target) as grpc_client:
        result = await grpc_client.generate(chat=CHATS[0], model="sql",
                                            max_tokens=MAX_TOKENS, temperature=0.0)
    assert answer.choices[0].message.content == result.text


async def test_decode_worker_refuses_kv_of_another_adapter(disagg_lora: DisaggStack) -> None:
    """A transfer handle names the adapter its KV was computed with: the decode worker
    never decodes it under another."""
    from pdserve.v1 import worker_pb2 as wpb
    from pdserve.v1 import worker_pb2_grpc as wpb_grpc

    async with grpc.aio.insecure_channel(disagg_lora.decode_target) as channel:
        call = wpb_grpc.DecodeServiceStub(channel).Decode(wpb.DecodeRequest(
            request_id="mixed-adapters", prompt_token_ids=[1, 2, 3], first_token_id=4,
            sampling=pb.SamplingParams(max_tokens=4), lora_name="sql",
            handle=wpb.TransferHandle(transfer_id="t1", num_tokens=3, lora_name="")))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "same adapter" in (err.value.details() or "")


async def test_the_router_loads_the_adapter_where_a_pair_lacks_it(
        pool_lora: ServerProcess, disagg_lora: DisaggStack, redis: RedisServer,
        adapters: dict[str, Path]) -> None:
    """Only the prefill worker holds `sql`: the router loads it on the decode worker
    before the request runs there (counted once), the decode worker's registry record
    then lists it, and the answer is the local pair's (colocated vLLM's, above)."""
    before = scrape(pool_lora.metrics_port, reason="request").get(
        "pdserve_router_lora_loads_total", 0.0)
    for chat in CHATS[:2]:
        assert await greedy(pool_lora.target, "sql", chat) == await greedy(
            disagg_lora.server.target, "sql", chat)
    after = scrape(pool_lora.metrics_port, reason="request")
    assert after["pdserve_router_lora_loads_total"] == before + 1
    registry = Registry.from_url(redis.url, signer=RecordSigner(SECRET.encode()))
    try:
        for _ in range(50):  # the next heartbeat carries it
            records = {w.worker_id: w for w in await registry.workers()}
            if "sql" in records["lora-d"].adapters:
                break
            await asyncio.sleep(0.1)
    finally:
        await registry.close()
    assert records["lora-d"].adapters == records["lora-p"].adapters == {
        "sql": str(adapters["sql"])}
