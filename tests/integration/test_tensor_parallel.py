"""Tensor parallelism through pdserve's own commands, with a tiny random-weight Llama the
test creates (4 heads, 2 KV heads): a colocated engine at TP=2 gives the greedy tokens of
one at TP=1, its two ranks each bound to a core of their own; and `serve --mode disagg`
with a prefill worker at TP=a feeding a decode worker at TP=b, for (a, b) in (1, 1),
(2, 1), (1, 2), (2, 2), gives the colocated TP=1 engine's tokens from KV moved between
the two layouts (each prefill rank ships its heads to the decode ranks that hold them),
through shared memory, and for two uneven pairs over torch and NIXL.
`test_tensor_parallel_stacks.py` takes the same model through `pdserve up` and through a
decode worker's SIGKILL.

On a 2-core machine the engines share the cores (the TP=1 engine on core 1, the TP=2
engine's ranks on cores 0 and 1; a disaggregated worker at TP=2 puts both its ranks on
its one core): oversubscribed, which changes speed, not results."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pdserve.v1 import generate_pb2 as pb
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


async def greedy_final(server: ServerProcess | str, prompt: str | list[int],
                       max_tokens: int = MAX_TOKENS
                       ) -> tuple[list[tuple[int, list[float]]], pb.Final]:
    """Each generated token with the top-2 log-probabilities at its position, and the
    final message."""
    out, final = [], pb.Final()
    what = {"text": prompt} if isinstance(prompt, str) else {"token_ids": prompt}
    target = server if isinstance(server, str) else server.target
    async with PdserveClient(target) as client:
        call = client.call(build_request(**what, temperature=0.0,  # type: ignore[arg-type]
                                         max_tokens=max_tokens, ignore_eos=True,
                                         logprobs=2), timeout=240)
        async for response in call:
            if response.HasField("chunk"):
                for token, lp in zip(response.chunk.token_ids, response.chunk.logprobs,
                                     strict=True):
                    out.append((token, sorted((t.logprob for t in lp.top), reverse=True)))
            elif response.HasField("final"):
                final = response.final
    return out, final


async def greedy(server: ServerProcess, prompt: str) -> list[tuple[int, list[float]]]:
    return (await greedy_final(server, prompt))[0]


def assert_same_greedy(one: list[tuple[int, list[float]]], two: list[tuple[int, list[float]]],
                       what: str) -> None:
    """`two` gives the greedy tokens of `one` (the reference); a flip is accepted only at a
    near-tie, and only the first difference counts: after it the two continue from
    different prefixes."""
    assert len(one) == len(two) == MAX_TOKENS
    tokens_one, tokens_two = [t for t, _ in one], [t for t, _ in two]
    if tokens_one == tokens_two:
        for (_, lp1), (_, lp2) in zip(one, two, strict=True):
            assert abs(lp1[0] - lp2[0]) < NEAR_TIE  # same distribution, not just same argmax
        return
    first = next(i for i, (a, b) in enumerate(zip(tokens_one, tokens_two, strict=True))
                 if a != b)
    top = one[first][1]
    gap = top[0] - top[1]
    print(f"{what}: tokens differ from position {first}; top-2 gap there {gap:.2e}")
    assert gap < NEAR_TIE, f"{what}: position {first}: the reference chose with a margin " \
        f"of {gap:.2e}"


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
    assert_same_greedy(one, two, f"colocated TP=2, {prompt!r}")


# (prefill TP, decode TP, KV transport): the four pairs over the default route (the two
# workers share the host: shared memory), and two uneven pairs over the network
# transports that keep their own connections per rank pair (shared memory off).
DISAGG_PAIRS = [(1, 1, "grpc"), (2, 1, "grpc"), (1, 2, "grpc"), (2, 2, "grpc"),
                (2, 1, "torch"), (1, 2, "nixl")]


@pytest.fixture(scope="module", params=DISAGG_PAIRS,
                ids=[f"prefill_tp{a}-decode_tp{b}-{kind}" for a, b, kind in DISAGG_PAIRS])
async def disagg(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
                 request: pytest.FixtureRequest) -> AsyncIterator[DisaggStack]:
    a, b, kind = request.param
    # The 'fail' policy: a KV load that went wrong fails the request instead of being
    # recomputed into the right tokens, which would hide it.
    stack = DisaggStack.create(
        tmp_path_factory.mktemp("tp-disagg") / f"disagg-{a}-{b}-{kind}.log", kind,
        "--model", str(tiny_model), "--max-model-len", "512", "--prefill-tp", str(a),
        "--decode-tp", str(b), "--kv-load-failure-policy", "fail",
        *(("--no-kv-shm",) if kind != "grpc" else ()))
    async with stack.server.running(timeout=600):
        yield stack


# The prompt KV each request moved, by prompt, as the first pair shipped it: every pair
# must move the same bytes (each head once, whatever the split).
SHIPPED: dict[str, int] = {}


async def test_disagg_between_tp_layouts_gives_the_colocated_tokens(
        engines: dict[int, ServerProcess], disagg: DisaggStack) -> None:
    """`--model PATH` through `serve --mode disagg --prefill-tp a --decode-tp b`: token
    for token (or a near-tie flip) what the colocated TP=1 engine gives, with the prompt's
    KV loaded from the transfer, all of it."""
    log = disagg.server.log_path.read_text(errors="replace")
    for prompt in PROMPTS:
        reference = await greedy(engines[1], prompt)
        got, final = await greedy_final(disagg.server, prompt)
        assert_same_greedy(reference, got, f"disagg {disagg.server.log_path.name}, {prompt!r}")
        shipped = final.timings.kv_transfer_bytes
        assert shipped > 0 and final.timings.kv_prompt_bytes == shipped, (
            final, disagg.server.log_tail(80))
        assert SHIPPED.setdefault(prompt, shipped) == shipped, (prompt, SHIPPED, shipped)
    assert "KV load for" not in log  # no load failed, none was recomputed


def refuse(tiny_model: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *argv, "--model",
                           str(tiny_model)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("argv", "words"), [
    (("serve", "--mode", "disagg", "--prefill-tp", "3"), "do not split over 3 ranks"),
    (("serve", "--mode", "disagg", "--decode-tp", "3"), "do not split over 3 ranks"),
])
def test_a_tp_the_model_cannot_split_is_refused_before_starting_engines(
        tiny_model: Path, argv: tuple[str, ...], words: str) -> None:
    done = refuse(tiny_model, *argv)
    assert done.returncode == 1, done.stdout + done.stderr
    assert words in done.stderr, done.stderr
    assert "starting vLLM engine" not in done.stdout + done.stderr


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
