"""The same-host transport between two GPU workers: KV device to device over CUDA IPC.

Needs a CUDA GPU (one is enough: the receiver lends its memory to a sender in another
process, which is what IPC is for); skipped, and said so, everywhere else. The parts that
need no GPU (the digest, the handle's validation, the offer to a receiver without a GPU,
a slab that cannot be mapped) are tested in tests/unit/test_cuda_ipc.py and
tests/integration/test_kv_transport.py.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from services.kv.fingerprint import LayoutFingerprint, PeerIdentity
from services.kv.transport import (
    TransferSpec,
    TransportConfig,
    cuda_ipc,
    make_receiver,
    make_sender,
    make_shm_sender,
)

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU"),
]

FP = LayoutFingerprint("smollm2-135m", "float16", 16, 4, 3, 64, "cuda", "0.1.0")
RX_ID = PeerIdentity("decode-0", 1, FP)
TX_ID = PeerIdentity("prefill-0", 1, FP)
SHAPE = (8, 3, 16, 128)
LAYERS = 6
CFG = TransportConfig(ipc_device="cuda:0", stall_timeout_s=10.0)


def receiver_process(conn: Any) -> None:
    """The decode side, in its own process: serve, then report what each transfer staged."""
    torch.cuda.set_device(0)
    rx = make_receiver("grpc", RX_ID, CFG, "127.0.0.1", 0)
    conn.send(rx.address)
    while (msg := conn.recv()) != "stop":
        tid = msg
        rx.wait(tid, 60.0)  # type: ignore[attr-defined]
        got = rx.take(tid)
        if got is None:
            conn.send({"ok": False, "error": rx.error(tid)})
            continue
        conn.send({"ok": True, "on_gpu": all(t.is_cuda for t in got.layers),
                   "digests": [cuda_ipc.device_digest(t) for t in got.layers]})
        rx.release(got)
    rx.close()
    conn.send("bye")


@pytest.fixture(scope="module")
def decode() -> Any:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_process, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(120), "the receiver process did not start"
    address = parent.recv()
    yield parent, address
    parent.send("stop")
    parent.poll(10)
    proc.join(10)


def ship(tx: Any, address: str, tid: str, layers: list[torch.Tensor]) -> Any:
    spec = TransferSpec(tid, LAYERS, SHAPE, torch.float16, 100, RX_ID.epoch, FP.digest())
    tx.begin(address, spec)
    for i, t in enumerate(layers):
        tx.send_layer(tid, i, t)
    tx.end(tid)
    for _ in range(100):
        for outcome in tx.poll_finished(wait_s=0.2):
            return outcome
    raise AssertionError(f"no outcome for {tid}")


def test_layers_go_device_to_device_and_arrive_bit_exact(decode: Any) -> None:
    conn, address = decode
    tx = make_shm_sender(TX_ID, CFG, make_sender("grpc", TX_ID, CFG))
    try:
        for round_ in range(3):  # the second and third reuse the lent slab and its mapping
            layers = [torch.randn(SHAPE, dtype=torch.float16, device="cuda") for _ in range(LAYERS)]
            outcome = ship(tx, address, f"ipc-{round_}", layers)
            assert outcome.ok, outcome.error
            assert tx.poll_fallbacks() == []  # neither a host segment nor the network
            conn.send(f"ipc-{round_}")
            got = conn.recv()
            assert got["ok"] and got["on_gpu"], got
            assert got["digests"] == [cuda_ipc.device_digest(t) for t in layers]
    finally:
        tx.close()
        tx.fallback.close()


def test_a_layer_damaged_after_its_digest_fails_the_transfer(decode: Any) -> None:
    conn, address = decode
    tx = make_shm_sender(TX_ID, CFG, make_sender("grpc", TX_ID, CFG))
    try:
        layers = [torch.randn(SHAPE, dtype=torch.float16, device="cuda") for _ in range(LAYERS)]
        spec = TransferSpec("ipc-bad", LAYERS, SHAPE, torch.float16, 100, 1, FP.digest())
        tx.begin(address, spec)
        tx.corrupt_after_checksum("ipc-bad")
        for i, t in enumerate(layers):
            tx.send_layer("ipc-bad", i, t)
        tx.end("ipc-bad")
        outcome = next(o for _ in range(100) for o in tx.poll_finished(wait_s=0.2))
        assert not outcome.ok and "checksum mismatch in layer 0" in (outcome.error or "")
        conn.send("ipc-bad")
        assert conn.recv()["ok"] is False
        ok = ship(tx, address, "ipc-after", layers)  # the receiver serves on
        assert ok.ok, ok.error
        conn.send("ipc-after")
        assert conn.recv()["ok"]
    finally:
        tx.close()
        tx.fallback.close()
