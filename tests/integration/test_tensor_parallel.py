"""Tensor parallelism through pdserve's own commands, with a tiny random-weight Llama the
test creates (4 heads, 2 KV heads): a colocated engine at TP=2 gives the greedy tokens of
one at TP=1, its two ranks each bound to a core of their own; `serve --mode disagg` at
TP=1 serves the same model folder with the same tokens; and where KV would have to move
between tensor-parallel workers, the disaggregated commands refuse at once, in words.

On a 2-core machine the two engines share the cores (the TP=1 engine on core 1, the TP=2
engine's ranks on cores 0 and 1): oversubscribed, which changes speed, not results."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.api.client import PdserveClient, build_request
from tests.helpers.servers import DisaggStack, ServerProcess
from tests.helpers.tiny_llama import make_tiny_llama

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
]
MAX_TOKENS = 24
# Where summation order differs (an all-reduce over two ranks against one sum), a greedy
# choice between two tokens this close in log-probability may flip; anything wider is a
# real difference.
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def tiny_model(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model", model_path)


def colocated(model: Path, log: Path, tp: int, cores: str) -> ServerProcess:
    return ServerProcess(["--mode", "colocated", "--model", str(model), "--kv-cache-gib", "1",
                          "--max-model-len", "512", "--tensor-parallel-size", str(tp),
                          "--cpu-cores", cores], log)


@pytest.fixture(scope="module")
async def engines(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[dict[int, ServerProcess]]:
    logs = tmp_path_factory.mktemp("tp-logs")
    servers = {1: colocated(tiny_model, logs / "tp1.log", 1, "1"),
               2: colocated(tiny_model, logs / "tp2.log", 2, "0-1")}
    for server in servers.values():
        server.start()
    try:
        await asyncio.gather(*(s.wait_ready(timeout=600) for s in servers.values()))
        yield servers
    finally:
        for server in servers.values():
            server.stop()


async def greedy(server: ServerProcess, prompt: str) -> list[tuple[int, list[float]]]:
    """Each generated token with the top-2 log-probabilities at its position."""
    out = []
    async with PdserveClient(server.target) as client:
        call = client.call(build_request(text=prompt, temperature=0.0, max_tokens=MAX_TOKENS,
                                         ignore_eos=True, logprobs=2), timeout=120)
        async for response in call:
            if response.HasField("chunk"):
                for token, lp in zip(response.chunk.token_ids, response.chunk.logprobs,
                                     strict=True):
                    out.append((token, sorted((t.logprob for t in lp.top), reverse=True)))
    return out


async def test_tp2_runs_two_ranks_each_on_its_own_core(
        engines: dict[int, ServerProcess]) -> None:
    log = engines[2].log_path.read_text(errors="replace")
    # vLLM's own account of the binding pdserve gave it (VLLM_CPU_OMP_THREADS_BIND=0|1)
    assert "local_rank=0, core ids=[0]" in log and "local_rank=1, core ids=[1]" in log, (
        engines[2].log_tail(60))
    assert "local_rank=1" not in engines[1].log_path.read_text(errors="replace")


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_colocated_tp2_gives_the_greedy_tokens_of_tp1(
        engines: dict[int, ServerProcess], prompt: str) -> None:
    one, two = await asyncio.gather(greedy(engines[1], prompt), greedy(engines[2], prompt))
    assert len(one) == len(two) == MAX_TOKENS
    tokens_one, tokens_two = [t for t, _ in one], [t for t, _ in two]
    if tokens_one == tokens_two:
        for (_, lp1), (_, lp2) in zip(one, two, strict=True):
            assert abs(lp1[0] - lp2[0]) < NEAR_TIE  # same distribution, not just same argmax
        return
    # A flip is accepted only at a near-tie, and only the first difference counts:
    # after it the two continue from different prefixes.
    first = next(i for i, (a, b) in enumerate(zip(tokens_one, tokens_two, strict=True))
                 if a != b)
    top = one[first][1]
    gap = top[0] - top[1]
    print(f"{prompt!r}: tokens differ from position {first}; top-2 gap there {gap:.2e}")
    assert gap < NEAR_TIE, f"position {first}: TP=1 chose with a margin of {gap:.2e}"


@pytest.fixture(scope="module")
async def disagg(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> AsyncIterator[DisaggStack]:
    stack = DisaggStack.create(tmp_path_factory.mktemp("tp-disagg") / "disagg.log", "grpc",
                               "--model", str(tiny_model), "--max-model-len", "512")
    async with stack.server.running(timeout=600):
        yield stack


async def test_disagg_tp1_on_any_model_folder_gives_the_colocated_tokens(
        engines: dict[int, ServerProcess], disagg: DisaggStack) -> None:
    """`--model PATH` through `serve --mode disagg`: prefill TP=1 -> decode TP=1 on the
    tiny model, token for token what the colocated TP=1 engine gives."""
    for prompt in PROMPTS:
        colocated_tokens = [t for t, _ in await greedy(engines[1], prompt)]
        disagg_tokens = [t for t, _ in await greedy(disagg.server, prompt)]
        assert disagg_tokens == colocated_tokens, prompt


def refuse(tiny_model: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *argv, "--model",
                           str(tiny_model)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [
    ("serve", "--mode", "disagg", "--prefill-tp", "2"),
    ("serve", "--mode", "disagg", "--decode-tp", "2"),
    ("serve", "--mode", "disagg", "--tensor-parallel-size", "2"),
    ("up", "--prefill-tp", "2", "--decode-tp", "1"),
    ("decode", "--tensor-parallel-size", "2"),
])
def test_kv_workers_with_tp_refuse_before_starting_engines(tiny_model: Path,
                                                           argv: tuple[str, ...]) -> None:
    done = refuse(tiny_model, *argv)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not supported yet" in done.stderr and "--mode colocated" in done.stderr
    assert "starting vLLM engine" not in done.stdout + done.stderr
    assert "Ray runtime started" not in done.stdout + done.stderr


def test_a_multi_gpu_worker_actor_holds_one_gpu_bundle_per_rank_for_its_ranks() -> None:
    """On a local Ray whose node declares GPUs (Ray's accounting only: no device is
    touched), the options `pdserve up` gives a decode worker of 2 ranks place it in a
    placement group of 2 one-GPU bundles, and the one-GPU actors it starts (as vLLM's Ray
    executor starts its rank workers) land in that group, one GPU each; a third finds none
    left."""
    import ray

    from services.launcher.actor_spec import RayOptions, ray_options
    from services.launcher.settings import LOOPBACK, LauncherConfig

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address=LOOPBACK,
             object_store_memory=128 << 20, namespace="pdserve-tp-test",
             resources={"pdserve_decode": 1, "accelerator_type:FAKE": 1})
    try:
        options = RayOptions.of(LauncherConfig(decode_accelerator="FAKE"), "decode",
                                "decode-0", ranks=2)
        kwargs, group = ray_options(options)
        assert group is not None
        ray.get(group.ready(), timeout=60)

        @ray.remote(num_gpus=1, num_cpus=0)
        class Rank:
            def where(self) -> tuple[str, list[int]]:
                here = ray.util.get_current_placement_group()
                return (here.id.hex() if here else "", [int(g) for g in ray.get_gpu_ids()])

        @ray.remote
        class Worker:
            def group(self) -> str:
                here = ray.util.get_current_placement_group()
                return here.id.hex() if here else ""

            def ranks(self, n: int) -> list[tuple[str, list[int]]]:
                # Rank actors hold their GPU while alive: the third finds none free.
                self.held = [Rank.remote() for _ in range(n)]  # type: ignore[attr-defined]
                ready, _ = ray.wait([r.where.remote() for r in self.held], num_returns=n,
                                    timeout=20)
                return ray.get(ready)

        actor = Worker.options(**kwargs).remote()  # type: ignore[attr-defined]
        assert ray.get(actor.group.remote(), timeout=60) == group.id.hex()
        placed = ray.get(actor.ranks.remote(3), timeout=120)
        assert len(placed) == 2, placed
        assert {g for g, _ in placed} == {group.id.hex()}
        assert sorted(i for _, ids in placed for i in ids) == [0, 1]
        ray.kill(actor)
        ray.util.remove_placement_group(group)
    finally:
        ray.shutdown()
