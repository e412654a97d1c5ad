"""The GPU data path, run by `make gpu-check` on a machine with CUDA GPUs (skipped, and
said so, everywhere else: the `gpu` marker, tests/conftest.py).

* NIXL with VRAM registration: both ends register GPU memory, the layers go GPU to GPU
  between two processes, verified with the GPU digest where they landed.
* The torch transport on NCCL, between two GPUs (needs two).
* CUDA vLLM engines with pdserve's connector (`serve --mode disagg`): greedy output
  token-identical to offline vLLM (float32 on both sides, so the comparison is exact),
  KV over the default same-host path (CUDA IPC) and over NIXL with shm off.
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
from tests.helpers.servers import DisaggStack

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
