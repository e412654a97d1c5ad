"""The GPU data path, run by `make gpu-check` on a machine with CUDA GPUs (skipped, and
said so, everywhere else: the `gpu` marker, tests/conftest.py).

* NIXL with VRAM registration: both ends register GPU memory, the layers go GPU to GPU
  between two processes, verified with the GPU digest where they landed.
* The torch transport on NCCL, between two GPUs (needs two).
* CUDA vLLM engines with pdserve's connector (`serve --mode disagg`): greedy output
  token-identical to offline vLLM (float32 on both sides, so the comparison is exact),
  KV over the default same-host path (CUDA IPC) and over NIXL with shm off.
* Tensor parallelism on devices (needs two GPUs; skipped, and said so, with fewer), with
  the tiny random-weight Llama test_tensor_parallel.py creates: a colocated engine at
  TP=2, one rank per GPU, gives the greedy tokens of one at TP=1, and `serve --mode
  disagg --prefill-tp 2 --decode-tp 2` gives the colocated TP=1 engine's tokens, a flip
  accepted only at a near-tie (test_tensor_parallel.py's rule: an all-reduce sums in
  another order). Equal sizes only: KV between different TP sizes is supported on CPU
  caches (test_tensor_parallel.py); GPU cache layouts are not checked for it yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.api.client import PdserveClient
from services.kv.fingerprint import LayoutFingerprint, PeerIdentity
from services.kv.transport import (
    TransferSpec,
    TransportConfig,
    cuda_ipc,
    make_receiver,
    make_sender,
)
from tests.conftest import REFERENCE_MAX_TOKENS, start_disagg
from tests.helpers.prompts import TEXT_PROMPTS
from tests.helpers.servers import DisaggStack, ServerProcess
from tests.helpers.tiny_llama import make_tiny_llama
from tests.integration.test_tensor_parallel import (
    PROMPTS,
    assert_same_greedy,
    greedy,
    greedy_final,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

FP = LayoutFingerprint("smollm2-135m", "float16", 16, 4, 3, 64, "cuda", "0.1.0")
RX_ID = PeerIdentity("decode-0", 1, FP)
TX_ID = PeerIdentity("prefill-0", 1, FP)
SHAPE = (8, 3, 16, 128)
LAYERS = 6
# Each engine of a disaggregated pair takes this share of the one GPU they share; the
# offline reference runs beside them with REFERENCE_GPU_MEMORY_UTILIZATION (gpu_check.sh).
ENGINE_GPU_SHARE = "0.3"


def receiver_main(kind: str, config: TransportConfig, conn: Any) -> None:
    """The decode side in its own process: serve, then report what each transfer staged
    (where, and the GPU digest of every layer)."""
    torch.cuda.set_device(torch.device(config.device))
    rx = make_receiver(kind, RX_ID, config, "127.0.0.1", 0)
    conn.send((rx.address, getattr(getattr(rx, "arena", None), "mem", "")))
    while (tid := conn.recv()) != "stop":
        rx.wait(tid, 60.0)  # type: ignore[attr-defined]
        got = rx.take(tid)
        if got is None:
            conn.send({"ok": False, "error": rx.error(tid)})
            continue
        conn.send({"ok": True, "devices": sorted({str(t.device) for t in got.layers}),
                   "digests": [cuda_ipc.device_digest(t) for t in got.layers]})
        rx.release(got)
    rx.close()
    conn.send("bye")


@dataclasses.dataclass
class Remote:
    conn: Any
    address: str
    mem: str


@contextlib.contextmanager
def remote_receiver(kind: str, config: TransportConfig) -> Iterator[Remote]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(kind, config, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(180), "the receiver process did not start"
        address, mem = parent.recv()
        yield Remote(parent, address, mem)
        parent.send("stop")
        parent.poll(10)
    finally:
        proc.kill()
        proc.join(10)


def ship(tx: Any, remote: Remote, tid: str, layers: list[torch.Tensor]) -> dict[str, Any]:
    spec = TransferSpec(tid, LAYERS, SHAPE, torch.float16, 100, RX_ID.epoch, FP.digest())
    tx.begin(remote.address, spec)
    for i, t in enumerate(layers):
        tx.send_layer(tid, i, t)
    tx.end(tid)
    outcome = next((o for _ in range(300) for o in tx.poll_finished(wait_s=0.2)), None)
    assert outcome is not None and outcome.ok, outcome
    remote.conn.send(tid)
    got: dict[str, Any] = remote.conn.recv()
    return got


def test_nixl_registers_vram_and_moves_layers_gpu_to_gpu() -> None:
    config = TransportConfig(gpu="cuda:0", device="cuda:0", pool_bytes=64 << 20)
    with remote_receiver("nixl", config) as remote:
        assert remote.mem == "VRAM"
        tx = make_sender("nixl", TX_ID, config)
        try:
            assert tx.arena.mem == "VRAM"  # type: ignore[attr-defined]
            for n in range(2):  # the second reuses the connection and both regions
                layers = [torch.randn(SHAPE, dtype=torch.float16, device="cuda:0")
                          for _ in range(LAYERS)]
                got = ship(tx, remote, f"vram-{n}", layers)
                assert got["ok"] and got["devices"] == ["cuda:0"], got
                assert got["digests"] == [cuda_ipc.device_digest(t) for t in layers]
                assert tx.poll_fallbacks() == []  # type: ignore[attr-defined]
        finally:
            tx.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two GPUs needs two")
def test_torch_transport_over_nccl_between_two_gpus() -> None:
    sender_cfg = TransportConfig(device="cuda:0")
    with remote_receiver("torch", TransportConfig(device="cuda:1")) as remote:
        tx = make_sender("torch", TX_ID, sender_cfg)
        try:
            layers = [torch.randn(SHAPE, dtype=torch.float16, device="cuda:0")
                      for _ in range(LAYERS)]
            got = ship(tx, remote, "nccl", layers)
            assert got["ok"] and got["devices"] == ["cuda:1"], got
            assert got["digests"] == [cuda_ipc.device_digest(t) for t in layers]
        finally:
            tx.close()


TRANSPORTS = {"grpc": (), "nixl": ("--no-kv-shm",)}


@pytest.fixture(scope="module", params=list(TRANSPORTS))
async def cuda_pair(request: pytest.FixtureRequest, model_path: Path,
                    session_dir: Path) -> AsyncIterator[DisaggStack]:
    extra = ("--dtype", "float32", "--gpu-memory-utilization", ENGINE_GPU_SHARE,
             *TRANSPORTS[request.param])
    async for stack in start_disagg(session_dir, f"{request.param}", *extra):
        yield stack


async def test_cuda_engines_with_the_connector_match_offline_vllm(
    cuda_pair: DisaggStack, offline_reference: list[dict[str, Any]]
) -> None:
    shipped = 0
    async with PdserveClient(cuda_pair.server.target) as client:
        assert (await client.model_info()).serving_mode == "disaggregated"
        for prompt, ref in zip(TEXT_PROMPTS, offline_reference, strict=True):
            result = await client.generate(
                text=prompt, temperature=0.0, max_tokens=REFERENCE_MAX_TOKENS
            )
            assert result.token_ids == ref["token_ids"], prompt[:40]
            shipped += result.timings.get("kv_transfer_bytes", 0) > 0
    assert shipped >= len(TEXT_PROMPTS) - 1
    log = cuda_pair.server.log_path.read_text(errors="replace")
    if "nixl" in cuda_pair.server.args:  # NIXL carried it, none handed to gRPC
        assert "Initialized NIXL agent" in log and "not NIXL" not in log
    else:  # same host, both on the GPU: CUDA IPC, never the network
        assert "goes over the network" not in log


# The TP engines' share of each GPU: small (the model is tiny), since the engines of the
# module's tests above may still hold theirs on GPU 0 when these start.
TP_GPU_SHARE = "0.1"
TP_ENGINE = ("--max-model-len", "512", "--dtype", "float32",
             "--gpu-memory-utilization", TP_GPU_SHARE)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="tensor parallelism at TP=2 needs two GPUs")


@pytest.fixture(scope="module")
def tiny_model(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("gpu-tiny-llama") / "model", model_path)


def gpu_colocated(model: Path, log: Path, tp: int) -> ServerProcess:
    return ServerProcess(["--mode", "colocated", "--model", str(model),
                          "--tensor-parallel-size", str(tp), *TP_ENGINE], log)


@pytest.fixture(scope="module")
async def gpu_tp1(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[ServerProcess]:
    """The reference: a colocated engine at TP=1 on one GPU."""
    server = gpu_colocated(tiny_model, tmp_path_factory.mktemp("gpu-tp") / "tp1.log", 1)
    async with server.running(timeout=600):
        yield server


@two_gpus
async def test_colocated_tp2_on_two_gpus_gives_the_greedy_tokens_of_tp1(
        gpu_tp1: ServerProcess, tiny_model: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    server = gpu_colocated(tiny_model, tmp_path_factory.mktemp("gpu-tp") / "tp2.log", 2)
    async with server.running(timeout=600):
        for prompt in PROMPTS:
            one, two = await greedy(gpu_tp1, prompt), await greedy(server, prompt)
            assert_same_greedy(one, two, f"GPU colocated TP=2, {prompt!r}")


@two_gpus
async def test_disagg_tp2_to_tp2_on_gpus_gives_the_colocated_tokens(
        gpu_tp1: ServerProcess, tiny_model: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each prefill rank ships its KV heads to the decode rank that holds the same ones;
    the prompt's KV is loaded from the transfer, all of it (the 'fail' policy: a load
    that went wrong fails the request instead of being recomputed into the right
    tokens)."""
    stack = DisaggStack.create(
        tmp_path_factory.mktemp("gpu-tp") / "disagg-2-2.log", "grpc", "--model",
        str(tiny_model), "--prefill-tp", "2", "--decode-tp", "2",
        "--kv-load-failure-policy", "fail", *TP_ENGINE)
    async with stack.server.running(timeout=600):
        for prompt in PROMPTS:
            reference = await greedy(gpu_tp1, prompt)
            got, final = await greedy_final(stack.server, prompt)
            assert_same_greedy(reference, got, f"GPU disagg TP=2 to TP=2, {prompt!r}")
            shipped = final.timings.kv_transfer_bytes
            assert shipped > 0 and final.timings.kv_prompt_bytes == shipped, (
                final, stack.server.log_tail(80))
        assert "KV load for" not in stack.server.log_path.read_text(errors="replace")
