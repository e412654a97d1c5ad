"""KV transports end to end: real servers on 127.0.0.1, real gloo pair groups, senders in
separate (spawned) processes where a process boundary matters.

Every fault test ends by checking that the same receiver still completes a normal transfer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from services.kv.fingerprint import LayoutFingerprint, PeerIdentity
from services.kv.transport import (
    ReceiveState,
    TransferOutcome,
    TransferSpec,
    TransportConfig,
    checksum,
    cuda_ipc,
    frames,
    grpc_receiver,
    make_receiver,
    make_sender,
    make_shm_sender,
    shm_segments,
    torch_pair,
)
from services.kv.transport.frames import FrameKind
from services.kv.transport.grpc_channel import PAIR, PUSH, SHM, channel_options
from services.kv.transport.grpc_receiver import GrpcKVReceiver
from services.kv.transport.shm_receiver import ShmInbound
from services.kv.transport.shm_sender import ShmKVSender
from services.kv.transport.slab_pool import SlabPool

pytestmark = pytest.mark.timeout(240)  # spawned senders import torch: slow on a busy host

FP = LayoutFingerprint("smollm2-135m", "float32", 16, 4, 3, 64, "cpu:avx2:k-transposed", "0.1.0")
RX_ID = PeerIdentity("decode-0", 11, FP)
TX_ID = PeerIdentity("prefill-0", 4, FP)
SHAPE = (2, 3, 16, 128)  # (blocks, kv heads, block size, 2 * head size)
LAYERS = 4
LAYER_BYTES = 2 * 3 * 16 * 128 * 4
CFG = TransportConfig(chunk_bytes=16 << 10, stall_timeout_s=1.0, lease_s=5.0)
KINDS = ["grpc", "torch", "shm", "nixl"]


def new_sender(kind: str, identity: PeerIdentity = TX_ID, cfg: TransportConfig = CFG) -> Any:
    """A sender of `kind`; "shm" falls back to a gRPC sender (the producer's pairing)."""
    if kind == "shm":
        return make_shm_sender(identity, cfg, make_sender("grpc", identity, cfg))
    return make_sender(kind, identity, cfg)


def kv_layers(seed: int, n: int = LAYERS) -> list[torch.Tensor]:
    """Arbitrary fp32 bit patterns (NaNs and denormals included): bit-exact or nothing."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-(2**31), 2**31 - 1, SHAPE, generator=g, dtype=torch.int32).view(
            torch.float32
        )
        for _ in range(n)
    ]


def spec_for(tid: str, **over: Any) -> TransferSpec:
    base: dict[str, Any] = dict(
        transfer_id=tid,
        num_layers=LAYERS,
        layer_shape=SHAPE,
        dtype=torch.float32,
        num_tokens=30,
        receiver_epoch=RX_ID.epoch,
        receiver_fingerprint=FP.digest(),
    )
    base.update(over)
    return TransferSpec(**base)


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True)
    )


def wait_outcome(sender: Any, tid: str, timeout: float = 10.0) -> TransferOutcome:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for o in sender.poll_finished(wait_s=0.2):
            if o.transfer_id == tid:
                return o
    raise AssertionError(f"no outcome for {tid}")


def wait_state(rx: Any, tid: str, state: ReceiveState, timeout: float) -> float:
    """Seconds until `tid` reached `state` (fails the test after `timeout`)."""
    t0 = time.monotonic()
    while rx.state(tid) is not state:
        assert time.monotonic() - t0 < timeout, f"{tid}: {rx.state(tid)}, {rx.error(tid)}"
        time.sleep(0.02)
    return time.monotonic() - t0


def send_all(sender: Any, address: str, tid: str, layers: list[torch.Tensor], **over: Any) -> None:
    sender.begin(address, spec_for(tid, **over))
    for i, t in enumerate(layers):
        sender.send_layer(tid, i, t)
    sender.end(tid)


def assert_still_serves(rx: Any, kind: str = "grpc") -> None:
    tx = new_sender(kind, TX_ID, CFG)
    try:
        layers = kv_layers(99)
        send_all(tx, rx.address, "after-fault", layers)
        assert wait_outcome(tx, "after-fault").ok
        got = rx.take("after-fault")
        assert got is not None and same_bits(got.layers, layers)
    finally:
        tx.close()


@pytest.fixture(scope="module")
def receivers() -> Iterator[dict[str, Any]]:
    kinds = ("grpc", "torch", "nixl")
    rxs = {kind: make_receiver(kind, RX_ID, CFG, "127.0.0.1", 0) for kind in kinds}
    rxs["shm"] = rxs["grpc"]  # every receiver serves shm on its one address
    yield rxs
    for rx in rxs.values():
        rx.close()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def rx(receivers: dict[str, Any], kind: str) -> Any:
    return receivers[kind]


@pytest.fixture
def tx(kind: str) -> Iterator[Any]:
    sender = new_sender(kind, TX_ID, CFG)
    yield sender
    sender.close()


# -- senders in their own processes ------------------------------------------------------


def sender_process(kind: str, address: str, conn: Any) -> None:
    """A prefill-side process driven over a pipe; module-level so "spawn" can import it."""
    torch.set_num_threads(1)
    sender = new_sender(kind, TX_ID, CFG)
    conn.send("ready")
    while conn.recv() == "two-concurrent":
        # Interleaved layers of two transfers, as a batch of two prompts produces them.
        a, b = kv_layers(1), kv_layers(2)
        sender.begin(address, spec_for("proc-a"))
        sender.begin(address, spec_for("proc-b"))
        for i in range(LAYERS):
            sender.send_layer("proc-a", i, a[i])
            sender.send_layer("proc-b", i, b[i])
        sender.end("proc-b")
        sender.end("proc-a")
        outcomes: list[TransferOutcome] = []
        while len(outcomes) < 2:
            outcomes += sender.poll_finished(wait_s=1.0)
        conn.send([(o.transfer_id, o.ok, o.error, o.nbytes) for o in outcomes])
    # "die-midway": hand over half the layers, then wait to be killed
    sender.begin(address, spec_for("proc-dies"))
    for i, t in enumerate(kv_layers(3)[: LAYERS // 2]):
        sender.send_layer("proc-dies", i, t)
    conn.send("half sent")
    time.sleep(60)


@pytest.fixture(scope="module")
def sender_procs(receivers: dict[str, Any]) -> Iterator[dict[str, tuple[Any, Any]]]:
    """One sender process per transport, started together (imports take seconds here)."""
    ctx = mp.get_context("spawn")
    procs = {}
    for kind in KINDS:
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=sender_process, args=(kind, receivers[kind].address, child), daemon=True
        )
        proc.start()
        procs[kind] = (proc, parent)
    for _, conn in procs.values():
        assert conn.poll(200) and conn.recv() == "ready"
    yield procs
    for proc, _ in procs.values():
        proc.kill()
        proc.join(5)


def sender_proc(procs: dict[str, tuple[Any, Any]], kind: str) -> tuple[Any, Any]:
    proc, conn = procs[kind]
    if not proc.is_alive():
        pytest.skip("this sender process was already killed by the kill test")
    return proc, conn


def test_two_concurrent_transfers_from_another_process_are_bit_exact(
    rx: Any, kind: str, sender_procs: dict[str, tuple[Any, Any]]
) -> None:
    _, conn = sender_proc(sender_procs, kind)
    conn.send("two-concurrent")
    assert conn.poll(30), "sender process reported nothing"
    results = sorted(conn.recv())
    total = LAYERS * LAYER_BYTES
    assert results == [("proc-a", True, None, total), ("proc-b", True, None, total)]
    for tid, seed in (("proc-a", 1), ("proc-b", 2)):
        got = rx.take(tid)
        assert got is not None and got.nbytes == total
        assert got.sender_worker_id == TX_ID.worker_id and got.first_byte_ts <= got.last_byte_ts
        assert same_bits(got.layers, kv_layers(seed))
        assert rx.take(tid) is None and rx.state(tid) is ReceiveState.UNKNOWN


def test_sender_process_killed_midway_fails_within_stall_timeout(
    rx: Any, kind: str, sender_procs: dict[str, tuple[Any, Any]]
) -> None:
    proc, conn = sender_proc(sender_procs, kind)
    conn.send("die-midway")
    assert conn.poll(30) and conn.recv() == "half sent"
    wait_state(rx, "proc-dies", ReceiveState.RECEIVING, 10)
    os.kill(proc.pid, signal.SIGKILL)
    took = wait_state(rx, "proc-dies", ReceiveState.FAILED, CFG.stall_timeout_s + 1.0)
    assert took <= CFG.stall_timeout_s + 0.5
    assert rx.take("proc-dies") is None
    proc.join(5)
    assert_still_serves(rx, kind)


# -- a hung receiver ----------------------------------------------------------------------


def receiver_process(conn: Any) -> None:
    """A decode-side receiver in a process of its own, to be stopped with SIGSTOP."""
    torch.set_num_threads(1)
    rx = make_receiver("grpc", RX_ID, CFG, "127.0.0.1", 0)  # serves Push and Shm
    conn.send(rx.address)
    conn.recv()  # until the test is done
    rx.close()


@pytest.mark.parametrize("kind", ["grpc", "shm"])
def test_a_hung_receiver_costs_its_own_transfers_not_the_engine(
    receivers: dict[str, Any], kind: str
) -> None:
    """A stopped decode process takes no layers. The sender's queue to it fills, then
    send_layer (the engine's forward pass, in the real producer) waits at most
    `send_block_s` before failing that transfer, later ones to it fail at once, and
    transfers to a healthy receiver go on undisturbed. Resumed, it is served again."""
    cfg = dataclasses.replace(CFG, send_queue_depth=2 * LAYERS, send_block_s=0.3,
                              stall_timeout_s=8.0)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_process, args=(child,), daemon=True)
    proc.start()
    tx = new_sender(kind, TX_ID, cfg)
    try:
        assert parent.poll(200), "the receiver process did not start"
        hung = parent.recv()
        os.kill(proc.pid, signal.SIGSTOP)

        outcomes: dict[str, TransferOutcome] = {}

        def outcome(tid: str, timeout: float = 0.0) -> TransferOutcome | None:
            deadline = time.monotonic() + timeout
            while tid not in outcomes:
                for o in tx.poll_finished(wait_s=0.05):
                    outcomes[o.transfer_id] = o
                if time.monotonic() > deadline:
                    break
            return outcomes.get(tid)

        def timed_send(tid: str, address: str, seed: int) -> float:
            """Seconds spent in send_layer: what the engine's forward pass waits."""
            layers, waited = kv_layers(seed), 0.0
            tx.begin(address, spec_for(tid))
            for i, t in enumerate(layers):
                t0 = time.monotonic()
                tx.send_layer(tid, i, t)
                waited += time.monotonic() - t0
            tx.end(tid)
            return waited

        # Transfers fill the queue to the stopped receiver (the network takes at most a
        # layer or two before the peer's flow-control window closes); then one finds no
        # slot: a bounded wait, and it fails, far sooner than the stall timeout.
        queued: list[str] = []
        for n in range(8):
            tid = f"queued-{n}"
            assert timed_send(tid, hung, n) < cfg.stall_timeout_s / 2
            failed = outcome(tid)
            if failed is not None:
                assert not failed.ok and "took none" in (failed.error or ""), failed
                break
            queued.append(tid)
        else:
            raise AssertionError("the queue to a stopped receiver never filled")
        assert len(queued) >= 2  # its depth held two whole transfers
        # The receiver is known stuck now: the next transfer fails without any wait.
        assert timed_send("fast-fail", hung, 10) < cfg.send_block_s
        fast = outcome("fast-fail", 2.0)
        assert fast is not None and not fast.ok
        # A healthy receiver is not held up by the hung one's full queue.
        healthy = receivers["grpc"]
        assert timed_send("healthy", healthy.address, 11) < 2.0
        ok = outcome("healthy", 10.0)
        assert ok is not None and ok.ok, ok
        got = healthy.take("healthy")
        assert got is not None and same_bits(got.layers, kv_layers(11))
        # Resumed within the stall timeout: the queued transfers complete.
        os.kill(proc.pid, signal.SIGCONT)
        for tid in queued:
            done = outcome(tid, cfg.stall_timeout_s + 5)
            assert done is not None and done.ok, (tid, done)
        # And the receiver takes new transfers again without waiting.
        assert timed_send("after", hung, 12) < 2.0
        after = outcome("after", 10.0)
        assert after is not None and after.ok, after
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        tx.close()
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# -- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "sender_fp", "expected"),
    [
        (
            {},
            LayoutFingerprint(
                "smollm2-135m", "float32", 128, 4, 3, 64, "cpu:avx2:k-transposed", "0.1.0"
            ),
            "block_size: 16 != 128",
        ),
        ({"receiver_epoch": 10}, FP, "stale receiver epoch: sender expects 10"),
        ({"receiver_fingerprint": "0123456789abcdef"}, FP, "expects receiver layout 0123"),
    ],
    ids=["layout", "epoch", "digest"],
)
def test_incompatible_peer_is_refused(
    rx: Any, kind: str, over: dict[str, Any], sender_fp: LayoutFingerprint, expected: str
) -> None:
    sender = new_sender(kind, PeerIdentity("prefill-x", 1, sender_fp), CFG)
    try:
        send_all(sender, rx.address, "refused", kv_layers(5), **over)
        outcome = wait_outcome(sender, "refused")
    finally:
        sender.close()
    assert not outcome.ok and outcome.nbytes == 0
    assert "refused" in (outcome.error or "") and expected in (outcome.error or "")
    assert rx.state("refused") is ReceiveState.UNKNOWN
    assert_still_serves(rx, kind)


def test_a_payload_that_starts_at_a_later_block_says_so(rx: Any, tx: Any, kind: str) -> None:
    # The prompt's first blocks were left out (the decode worker holds them): the header
    # names the block the payload starts at, and it arrives as the payload's block 0.
    layers = [t[1:].contiguous() for t in kv_layers(7)]  # one block of two
    shape = (1, *SHAPE[1:])
    send_all(tx, rx.address, f"from-block-{kind}", layers, layer_shape=shape, first_block=5)
    outcome = wait_outcome(tx, f"from-block-{kind}")
    assert outcome.ok and outcome.nbytes == LAYERS * LAYER_BYTES // 2
    got = rx.take(f"from-block-{kind}")
    assert got is not None and got.spec.first_block == 5 and got.spec.layer_shape == shape
    assert same_bits(got.layers, layers)
    assert_still_serves(rx, kind)
    # a transfer that names none starts at block 0
    send_all(tx, rx.address, f"from-block-0-{kind}", kv_layers(8))
    assert wait_outcome(tx, f"from-block-0-{kind}").ok
    whole = rx.take(f"from-block-0-{kind}")
    assert whole is not None and whole.spec.first_block == 0


# -- sender-side misuse, stalls, cancel, lease ----------------------------------------------


def test_sender_rejects_wrong_tensors_without_raising(rx: Any, tx: Any, kind: str) -> None:
    tx.begin(rx.address, spec_for("bad-shape"))
    tx.send_layer("bad-shape", 0, torch.zeros(2, 3, 16, 64))
    outcome = wait_outcome(tx, "bad-shape")
    assert not outcome.ok and "spec says (2, 3, 16, 128)" in (outcome.error or "")
    tx.send_layer("bad-shape", 1, kv_layers(1)[1])  # late calls are ignored
    tx.begin(rx.address, spec_for("too-few"))
    tx.send_layer("too-few", 0, kv_layers(1)[0])
    tx.end("too-few")
    outcome = wait_outcome(tx, "too-few")
    assert not outcome.ok and "end() after 1 of 4 layers" in (outcome.error or "")
    for tid in ("bad-shape", "too-few"):
        state = wait_state_not_receiving(rx, tid)
        assert state in (ReceiveState.UNKNOWN, ReceiveState.FAILED)
    assert_still_serves(rx, kind)


def wait_state_not_receiving(rx: Any, tid: str) -> ReceiveState:
    deadline = time.monotonic() + CFG.stall_timeout_s + 1.0
    while rx.state(tid) is ReceiveState.RECEIVING and time.monotonic() < deadline:
        time.sleep(0.02)
    return rx.state(tid)


def test_stalled_sender_fails_both_sides(rx: Any, tx: Any, kind: str) -> None:
    tx.begin(rx.address, spec_for("stalls"))
    tx.send_layer("stalls", 0, kv_layers(1)[0])
    wait_state(rx, "stalls", ReceiveState.RECEIVING, 5)
    took = wait_state(rx, "stalls", ReceiveState.FAILED, CFG.stall_timeout_s + 1.0)
    assert took <= CFG.stall_timeout_s + 0.5
    # Both ends time the stall; whichever fires first names it.
    error = rx.error("stalls") or ""
    # (A shm sender that times out first cancels and ends its stream: the receiver sees
    # either the drop or the end of the stream, whichever gRPC delivers first.)
    dropped = kind == "shm" and ("stream dropped" in error or "stream ended before" in error)
    assert "stalled: no data for 1.0s" in error or "no progress" in error or dropped, error
    outcome = wait_outcome(tx, "stalls")
    assert not outcome.ok and outcome.error
    if kind == "torch":  # the receiver sends no ack for a stall: the sender's own timer ends it
        assert "no progress for" in outcome.error and "waiting for layers" in outcome.error
    assert_still_serves(rx, kind)


def test_cancel_drops_the_transfer(rx: Any, tx: Any, kind: str) -> None:
    tx.begin(rx.address, spec_for("cancelled"))
    tx.send_layer("cancelled", 0, kv_layers(1)[0])
    wait_state(rx, "cancelled", ReceiveState.RECEIVING, 5)
    tx.cancel("cancelled")
    outcome = wait_outcome(tx, "cancelled")
    assert not outcome.ok and outcome.error == "cancelled by sender"
    wait_state(rx, "cancelled", ReceiveState.FAILED, 2)
    assert rx.take("cancelled") is None
    assert_still_serves(rx, kind)


def test_unreachable_receiver_is_an_outcome(tx: Any) -> None:
    tx.begin("127.0.0.1:1", spec_for("nowhere"))
    outcome = wait_outcome(tx, "nowhere")
    assert not outcome.ok and outcome.error


def test_untaken_transfer_expires_and_taken_one_is_gone() -> None:
    lease = 1.5  # long enough to check state on a loaded machine, short enough to wait out
    cfg = TransportConfig(chunk_bytes=16 << 10, stall_timeout_s=1.0, lease_s=lease)
    rx = make_receiver("grpc", RX_ID, cfg, "127.0.0.1", 0)
    tx = make_sender("grpc", TX_ID, cfg)
    try:
        assert isinstance(rx, GrpcKVReceiver)
        send_all(tx, rx.address, "kept", kv_layers(7))
        assert wait_outcome(tx, "kept").ok
        t_kept = time.monotonic()
        send_all(tx, rx.address, "taken", kv_layers(7))
        assert wait_outcome(tx, "taken").ok
        assert rx.state("kept") is ReceiveState.COMPLETE
        assert rx.table.staged_bytes == 2 * LAYERS * LAYER_BYTES
        assert rx.take("taken") is not None and rx.take("taken") is None
        assert rx.state("taken") is ReceiveState.UNKNOWN
        wait_state(rx, "kept", ReceiveState.UNKNOWN, lease + 2.0)
        assert time.monotonic() - t_kept >= lease - 0.5  # not dropped early
        assert rx.take("kept") is None and rx.table.staged_bytes == 0
        rx.discard("nothing-here")  # harmless
    finally:
        tx.close()
        rx.close()


def test_released_staging_memory_is_reused(receivers: dict[str, Any]) -> None:
    rx = receivers["grpc"]
    tx = make_sender("grpc", TX_ID, CFG)
    try:
        send_all(tx, rx.address, "pooled-1", kv_layers(1))
        assert wait_outcome(tx, "pooled-1").ok
        first = rx.take("pooled-1")
        assert first is not None and first.storage is not None
        ptr = first.storage.data_ptr()
        rx.release(first)
        assert first.layers == [] and first.storage is None
        send_all(tx, rx.address, "pooled-2", kv_layers(2))
        assert wait_outcome(tx, "pooled-2").ok
        second = rx.take("pooled-2")
        assert second is not None and second.storage is not None
        assert second.storage.data_ptr() == ptr and same_bits(second.layers, kv_layers(2))
    finally:
        tx.close()


def test_discard_while_receiving(rx: Any, tx: Any, kind: str) -> None:
    tid = f"discarded-{kind}"  # a discarded id is refused for a lease: one per case
    tx.begin(rx.address, spec_for(tid))
    tx.send_layer(tid, 0, kv_layers(1)[0])
    wait_state(rx, tid, ReceiveState.RECEIVING, 5)
    rx.discard(tid)
    assert rx.state(tid) is ReceiveState.UNKNOWN
    for i, t in enumerate(kv_layers(1)[1:], start=1):
        tx.send_layer(tid, i, t)
    tx.end(tid)
    assert not wait_outcome(tx, tid).ok
    assert rx.take(tid) is None
    assert_still_serves(rx, kind)


def test_a_released_transfer_is_refused_when_it_arrives(rx: Any, tx: Any, kind: str) -> None:
    # Released before its sender started (the router's Release after a cancel can beat
    # the prefill worker's first frame): the transfer is turned away, nothing is staged,
    # and the sender hears of it (so the prefill side frees its blocks at once).
    tid, before = f"released-early-{kind}", rx.staged()
    rx.discard(tid)
    send_all(tx, rx.address, tid, kv_layers(2))
    outcome = wait_outcome(tx, tid)
    assert not outcome.ok and "released by the receiver" in (outcome.error or ""), outcome
    assert rx.state(tid) is ReceiveState.UNKNOWN
    assert rx.staged() == before
    assert_still_serves(rx, kind)


def test_a_transfer_released_while_its_buffers_are_made_is_refused() -> None:
    # The table's lock is not held while a header's slab is allocated: a release that
    # lands then must still turn the transfer away, not leave it staged for its lease
    # (seen as one staged transfer left after a burst of cancelled requests).
    from services.kv.transport.slab_pool import SlabPool
    from services.kv.transport.staging import Refused, StagingTable

    table, tid = StagingTable(RX_ID, CFG), "released-mid-open"

    class ReleasingPool(SlabPool):  # a real pool whose get() lets the release land
        def get(self, nbytes: int) -> torch.Tensor:
            table.discard(tid)
            return super().get(nbytes)

    pool = ReleasingPool(torch.device("cpu"), 1 << 30)
    with pytest.raises(Refused, match="released by the receiver"):
        table.open(TX_ID, spec_for(tid), CFG.checksum, pool=pool)
    assert table.state(tid) is ReceiveState.UNKNOWN and table.staged_bytes == 0
    assert pool.pooled_bytes >= LAYERS * LAYER_BYTES  # its slab went back for reuse


# -- hostile or broken gRPC streams --------------------------------------------------------


def data(layer: int, chunk: int, offset: int, payload: bytes) -> bytes:
    return frames.encode_data(layer, chunk, offset, memoryview(payload), CFG.checksum)


def header(tid: str, algorithm: str = "crc32c", **over: Any) -> bytes:
    return frames.encode_header(TX_ID, spec_for(tid, **over), algorithm)


def push_raw(address: str, stream: list[bytes]) -> grpc.RpcError | bytes:
    with grpc.insecure_channel(address, options=channel_options(CFG)) as channel:
        try:
            reply: bytes = channel.stream_unary(PUSH)(iter(stream), timeout=10)
            return reply
        except grpc.RpcError as e:
            return e


def full_stream(tid: str, algorithm: str = "crc32c") -> list[bytes]:
    out = [header(tid, algorithm)]
    for layer, t in enumerate(kv_layers(8)):
        view = frames.byte_view(t)
        for idx, off, n in frames.chunk_ranges(len(view), CFG.chunk_bytes):
            out.append(frames.encode_data(layer, idx, off, view[off : off + n], algorithm))
    chunks = len(out) - 1
    end = {"chunks": chunks, "nbytes": LAYERS * LAYER_BYTES}
    return [*out, frames.encode_control(FrameKind.END, end)]


CHUNK = b"\x01" * 1024


def corrupt_crc(frame: bytes) -> bytes:
    raw = bytearray(frame)
    raw[frames.DATA_HEADER_BYTES - 1] ^= 0xFF  # last byte of the checksum field
    return bytes(raw)


@pytest.mark.parametrize(
    ("build", "code", "reason"),
    [
        (lambda s: [s[1], *s[2:]], grpc.StatusCode.INVALID_ARGUMENT, "DATA frame before any"),
        (lambda s: [], grpc.StatusCode.INVALID_ARGUMENT, "empty stream"),
        (lambda s: [b"\x07"], grpc.StatusCode.INVALID_ARGUMENT, "malformed frame"),
        (lambda s: [s[0], s[1], corrupt_crc(s[2])], grpc.StatusCode.DATA_LOSS, "checksum"),
        (lambda s: [s[0], s[2], s[1]], grpc.StatusCode.INVALID_ARGUMENT, "out-of-order chunk 1"),
        (lambda s: [s[0], s[1], s[1]], grpc.StatusCode.INVALID_ARGUMENT, "duplicate chunk 0"),
        (lambda s: [s[0], s[1], s[-1]], grpc.StatusCode.DATA_LOSS, "truncated: end after"),
        (lambda s: s[:-1], grpc.StatusCode.DATA_LOSS, "stream ended before the end frame"),
        (lambda s: [s[0], data(9, 0, 0, CHUNK)], grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
        (
            lambda s: [s[0], data(0, 0, 0, b"\x00" * (LAYER_BYTES + 4))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "wrong size",
        ),
        (lambda s: [s[0], data(0, 0, 8, CHUNK)], grpc.StatusCode.INVALID_ARGUMENT, "offset 8"),
        (lambda s: [*s[:3], header("x")], grpc.StatusCode.INVALID_ARGUMENT, "unexpected HEADER"),
        (
            lambda s: [*s[:-1], frames.encode_control(FrameKind.END, {"chunks": 1, "nbytes": 1})],
            grpc.StatusCode.INVALID_ARGUMENT,
            "end frame counts 1 chunks",
        ),
    ],
    ids=[
        "data-before-header",
        "empty",
        "garbage",
        "bad-crc",
        "out-of-order",
        "duplicate",
        "end-too-early",
        "no-end-frame",
        "unknown-layer",
        "oversized-chunk",
        "wrong-offset",
        "second-header",
        "end-counts-lie",
    ],
)
def test_broken_grpc_streams_fail_with_a_reason(
    receivers: dict[str, Any], build: Any, code: grpc.StatusCode, reason: str
) -> None:
    rx = receivers["grpc"]
    tid = f"hostile-{uuid.uuid4().hex[:8]}"  # a discarded id is refused for a lease
    result = push_raw(rx.address, build(full_stream(tid)))
    assert isinstance(result, grpc.RpcError), result
    assert result.code() is code and reason in (result.details() or "")
    if rx.state(tid) is not ReceiveState.UNKNOWN:  # the header was accepted
        assert rx.state(tid) is ReceiveState.FAILED and reason in (rx.error(tid) or "")
    assert rx.take(tid) is None
    assert push_raw(rx.address, full_stream("clean")) == frames.encode_ack(
        "clean", True, None, LAYERS * LAYER_BYTES
    )
    assert rx.take("clean") is not None
    rx.discard(tid)


def test_dropped_grpc_stream_fails_at_once(receivers: dict[str, Any]) -> None:
    rx, gate = receivers["grpc"], threading.Event()
    stream = full_stream("dropped")

    def frames_then_hang() -> Iterator[bytes]:
        yield from stream[:3]
        gate.wait(10)

    with grpc.insecure_channel(rx.address, options=channel_options(CFG)) as channel:
        fut = channel.stream_unary(PUSH).future(frames_then_hang())
        wait_state(rx, "dropped", ReceiveState.RECEIVING, 5)
        fut.cancel()
        took = wait_state(rx, "dropped", ReceiveState.FAILED, 2)
        gate.set()
    error = rx.error("dropped") or ""
    # gRPC reports a reset stream either as an error or as an early end, by timing.
    assert took < 0.8 and ("stream dropped" in error or "vanished" in error), error
    assert_still_serves(rx)


# -- torch pair streams -----------------------------------------------------------------------


def test_corrupted_payload_fails_and_the_sender_keeps_working(rx: Any, tx: Any) -> None:
    tx.begin(rx.address, spec_for("corrupt"))
    tx.corrupt_after_checksum("corrupt")
    for i, t in enumerate(kv_layers(4)):
        tx.send_layer("corrupt", i, t)
    tx.end("corrupt")
    outcome = wait_outcome(tx, "corrupt")
    assert not outcome.ok and "checksum mismatch in" in (outcome.error or "")
    assert rx.state("corrupt") is ReceiveState.FAILED and rx.take("corrupt") is None
    assert "checksum mismatch" in (rx.error("corrupt") or "")
    send_all(tx, rx.address, "after-corrupt", kv_layers(6))  # same sender (and torch pair)
    assert wait_outcome(tx, "after-corrupt").ok
    got = rx.take("after-corrupt")
    assert got is not None and same_bits(got.layers, kv_layers(6))


class RoguePair:
    """A hand-driven pair (control stream + gloo group) that can send what it likes."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.control: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.call = channel.stream_stream(PAIR)(iter(self.control.get, None))
        hello = {"sender": TX_ID.to_dict(), "pair_id": "rogue", "receiver_host": "127.0.0.1"}
        self.put(FrameKind.HELLO, {**hello, "device": "cpu"})
        ready = frames.decode_frame(next(self.call))
        assert isinstance(ready, frames.ControlFrame) and ready.kind is FrameKind.READY
        store = torch.distributed.TCPStore("127.0.0.1", ready.body["store_port"])
        prefixed = torch.distributed.PrefixStore(ready.body["prefix"], store)
        self.pg = torch_pair.build_pair_group(prefixed, 0, "127.0.0.1", "cpu", 5.0)
        self.tag = 0

    def put(self, kind: FrameKind, body: dict[str, Any]) -> None:
        self.control.put(frames.encode_control(kind, body))

    def layer(self, tid: str, layer: int, flat: torch.Tensor, announced: int) -> None:
        self.tag += 1
        crc = torch_pair.payload_checksum(CFG.checksum, flat)
        body = {"transfer_id": tid, "layer": layer, "nbytes": announced, "checksum": crc}
        self.put(FrameKind.LAYER, {**body, "tag": self.tag})
        self.pg.send([flat], 1, self.tag).wait()

    def close(self) -> None:
        self.control.put(None)
        self.call.cancel()
        self.pg.abort()


def test_torch_wrong_layer_size_is_drained_not_fatal(receivers: dict[str, Any]) -> None:
    """A LAYER frame whose size disagrees with the spec fails that transfer; the receiver
    still takes the payload (gloo would kill it otherwise) and the pair keeps working."""
    rx = receivers["torch"]
    with grpc.insecure_channel(rx.address, options=channel_options(CFG)) as channel:
        rogue = RoguePair(channel)
        try:
            rogue.control.put(header("torch-wrong-size"))
            wrong = torch.zeros(100, dtype=torch.uint8)
            rogue.layer("torch-wrong-size", 0, wrong, announced=100)
            tid, ok, error, _ = frames.decode_ack(next(rogue.call))
            assert (tid, ok) == ("torch-wrong-size", False) and "wrong size" in (error or "")
            rogue.layer("torch-wrong-size", 1, wrong, announced=100)  # drained
            good = kv_layers(12)
            rogue.control.put(header("torch-after-drain"))
            for i, t in enumerate(good):
                flat = t.reshape(-1).view(torch.uint8)
                rogue.layer("torch-after-drain", i, flat, announced=flat.numel())
            end = {"chunks": LAYERS, "nbytes": LAYERS * LAYER_BYTES}
            rogue.put(FrameKind.END, {"transfer_id": "torch-after-drain", **end})
            assert frames.decode_ack(next(rogue.call))[:2] == ("torch-after-drain", True)
        finally:
            rogue.close()
    got = rx.take("torch-after-drain")
    assert got is not None and same_bits(got.layers, good)
    assert rx.state("torch-wrong-size") is ReceiveState.FAILED
    assert_still_serves(rx, "torch")


def test_torch_unknown_and_duplicate_layers(receivers: dict[str, Any]) -> None:
    rx, layer = receivers["torch"], kv_layers(13)[0].reshape(-1).view(torch.uint8)
    with grpc.insecure_channel(rx.address, options=channel_options(CFG)) as channel:
        rogue = RoguePair(channel)
        try:
            rogue.layer("never-announced", 0, layer, announced=layer.numel())  # drained
            rogue.control.put(header("torch-dup"))
            rogue.layer("torch-dup", 0, layer, announced=layer.numel())
            rogue.layer("torch-dup", 0, layer, announced=layer.numel())
            tid, ok, error, _ = frames.decode_ack(next(rogue.call))
            assert (tid, ok, error) == ("torch-dup", False, "duplicate layer 0")
        finally:
            rogue.close()
    assert rx.state("torch-dup") is ReceiveState.FAILED
    assert rx.state("never-announced") is ReceiveState.UNKNOWN
    assert_still_serves(rx, "torch")


def test_torch_sender_reuses_its_pair(receivers: dict[str, Any]) -> None:
    rx = receivers["torch"]
    tx = make_sender("torch", TX_ID, CFG)
    try:
        for tid in ("reuse-1", "reuse-2"):
            send_all(tx, rx.address, tid, kv_layers(3))
            assert wait_outcome(tx, tid).ok
            assert rx.take(tid) is not None
        assert tx.pair_count == 1
    finally:
        tx.close()


# -- checksum algorithms ---------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", checksum.ALGORITHMS)
def test_every_checksum_algorithm_delivers_and_catches_corruption(
    rx: Any, kind: str, algorithm: str
) -> None:
    """The receiver verifies with the algorithm the sender's header names."""
    tx = new_sender(kind, TX_ID, dataclasses.replace(CFG, checksum=algorithm))
    try:
        layers = kv_layers(21)
        send_all(tx, rx.address, f"sum-{algorithm}", layers)
        assert wait_outcome(tx, f"sum-{algorithm}").ok
        got = rx.take(f"sum-{algorithm}")
        assert got is not None and same_bits(got.layers, layers)
        tid = f"sum-{algorithm}-corrupt"
        tx.begin(rx.address, spec_for(tid))
        tx.corrupt_after_checksum(tid)
        for i, t in enumerate(layers):
            tx.send_layer(tid, i, t)
        tx.end(tid)
        outcome = wait_outcome(tx, tid)
        assert not outcome.ok and "checksum mismatch" in (outcome.error or "")
    finally:
        tx.close()
    assert_still_serves(rx, kind)


def test_unknown_checksum_algorithm_is_refused(receivers: dict[str, Any]) -> None:
    rx = receivers["grpc"]
    stream = full_stream("unknown-sum")
    result = push_raw(rx.address, [header("unknown-sum", "md5"), *stream[1:]])
    assert isinstance(result, grpc.RpcError)
    assert result.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown checksum algorithm 'md5'" in (result.details() or "")
    assert rx.state("unknown-sum") is ReceiveState.UNKNOWN
    trx = receivers["torch"]
    with grpc.insecure_channel(trx.address, options=channel_options(CFG)) as channel:
        rogue = RoguePair(channel)
        try:
            rogue.control.put(header("torch-unknown-sum", "md5"))
            tid, ok, error, _ = frames.decode_ack(next(rogue.call))
            assert (tid, ok) == ("torch-unknown-sum", False)
            assert "unknown checksum algorithm 'md5'" in (error or "")
        finally:
            rogue.close()
    assert_still_serves(rx)
    assert_still_serves(trx, "torch")


# -- same-host shared memory -------------------------------------------------------------------


def on_disk(names: set[str]) -> set[str]:
    return {n for n in names if (shm_segments.SHM_DIR / n).exists()}


def test_shm_reuses_one_segment_and_stages_without_a_copy(receivers: dict[str, Any]) -> None:
    rx = receivers["shm"]
    tx = new_sender("shm")
    try:
        pointers = set()
        for i in range(3):
            layers = kv_layers(30 + i)
            send_all(tx, rx.address, f"shm-{i}", layers)
            assert wait_outcome(tx, f"shm-{i}").ok
            got = rx.take(f"shm-{i}")
            assert got is not None and same_bits(got.layers, layers)
            assert got.storage is not None and rx.segments.owns(got.storage)
            pointers.add(got.layers[0].data_ptr())
            rx.release(got)
        assert len(pointers) == 1  # the same prefaulted segment every time
        assert tx.fallback.poll_finished() == [] and tx.poll_fallbacks() == []
    finally:
        tx.close()
        tx.fallback.close()


@contextlib.contextmanager
def receiver_and_shm_sender(
    cfg: TransportConfig, sender_cfg: TransportConfig = CFG
) -> Iterator[tuple[Any, Any]]:
    """A fresh receiver with `cfg` and a shm sender (with its gRPC fallback), closed after."""
    rx = make_receiver("grpc", RX_ID, cfg, "127.0.0.1", 0)
    tx = new_sender("shm", TX_ID, sender_cfg)
    try:
        yield rx, tx
    finally:
        tx.close()
        tx.fallback.close()
        rx.close()


def shm_raw(address: str, tid: str, layers: list[torch.Tensor],
            announce: Any) -> grpc.RpcError | bytes:
    """A Shm stream driven by hand: HEADER, then on SEGMENT write `layers` into the
    segment and send the frames `announce(segment reply body, checksums)` returns, then
    END; the receiver's last reply, or its error."""
    control: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    control.put(header(tid))
    with grpc.insecure_channel(address, options=channel_options(CFG)) as channel:
        call = channel.stream_stream(SHM)(iter(control.get, None), timeout=10)
        try:
            body = frames.decode_frame(next(call)).body  # type: ignore[union-attr]
            seg = shm_segments.map_segment(body["name"], body["nbytes"])
            sums = []
            for i, t in enumerate(layers):
                region = seg[i * LAYER_BYTES : (i + 1) * LAYER_BYTES]
                region.copy_(t.reshape(-1).view(torch.uint8))
                sums.append(checksum.digest(CFG.checksum, frames.byte_view(region)))
            for frame in announce(body, sums):
                control.put(frame)
            control.put(frames.encode_control(FrameKind.END, {"chunks": LAYERS,
                                                              "nbytes": LAYERS * LAYER_BYTES}))
            reply: bytes = next(call)
            return reply
        except grpc.RpcError as e:
            return e
        finally:
            control.put(None)


def layer_frame(**body: Any) -> bytes:
    return frames.encode_control(FrameKind.LAYER, body)


def batched(_: dict[str, Any], sums: list[int]) -> list[bytes]:
    return [layer_frame(layers=[[i, LAYER_BYTES, v] for i, v in enumerate(sums[:3])]),
            layer_frame(layers=[[3, LAYER_BYTES, sums[3]]])]


def one_per_layer(_: dict[str, Any], sums: list[int]) -> list[bytes]:
    """What senders that predate batched announcements send."""
    return [layer_frame(transfer_id="x", layer=i, nbytes=LAYER_BYTES, checksum=v)
            for i, v in enumerate(sums)]


@pytest.mark.parametrize("announce", [batched, one_per_layer], ids=["batched", "one-per-layer"])
def test_shm_takes_layers_announced_together_or_one_by_one(
    receivers: dict[str, Any], announce: Any
) -> None:
    rx, layers, tid = receivers["shm"], kv_layers(45), f"shm-raw-{uuid.uuid4().hex[:6]}"
    offers = []

    def frames_of(body: dict[str, Any], sums: list[int]) -> list[bytes]:
        offers.append(body.get("batches"))
        return announce(body, sums)  # type: ignore[no-any-return]

    reply = shm_raw(rx.address, tid, layers, frames_of)
    assert offers == [True]  # this receiver says it takes batched announcements
    assert reply == frames.encode_ack(tid, True, None, LAYERS * LAYER_BYTES), reply
    got = rx.take(tid)
    assert got is not None and same_bits(got.layers, layers)
    rx.release(got)


def test_shm_sender_announces_layer_by_layer_to_a_receiver_that_does_not_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A receiver of the protocol before batched announcements: it offers no `batches` in
    # SEGMENT and takes only the one-layer form. The sender must fall back to that form.
    def one_layer_only(self: ShmInbound, st: Any, body: dict[str, Any]) -> None:
        if "layers" in body:
            raise frames.FrameError("missing field 'layer'")
        self._verify(st, *(frames.field(body, k, int) for k in ("layer", "nbytes", "checksum")))

    monkeypatch.setattr(ShmInbound, "batches", False)
    monkeypatch.setattr(ShmInbound, "_verify_all", one_layer_only)
    with receiver_and_shm_sender(CFG) as (rx, tx):
        layers = kv_layers(47)
        send_all(tx, rx.address, "shm-old-rx", layers)  # all queued at once: would batch
        assert wait_outcome(tx, "shm-old-rx").ok and tx.poll_fallbacks() == []
        got = rx.take("shm-old-rx")
        assert got is not None and same_bits(got.layers, layers)


@pytest.mark.parametrize(
    ("announce", "code", "reason"),
    [
        (lambda b, s: [layer_frame(layers=[])], grpc.StatusCode.INVALID_ARGUMENT,
         "announces 0 layers"),
        (lambda b, s: [layer_frame(layers=[[0, LAYER_BYTES, s[0]]] * (LAYERS + 1))],
         grpc.StatusCode.INVALID_ARGUMENT, "announces 5 layers"),
        (lambda b, s: [layer_frame(layers=[[0, LAYER_BYTES]])], grpc.StatusCode.INVALID_ARGUMENT,
         "must be [layer, nbytes, checksum]"),
        (lambda b, s: [layer_frame(layers=[[0, LAYER_BYTES, True]])],
         grpc.StatusCode.INVALID_ARGUMENT, "must be [layer, nbytes, checksum]"),
        (lambda b, s: [layer_frame(layers="0")], grpc.StatusCode.INVALID_ARGUMENT,
         "field 'layers' must be list"),
        (lambda b, s: [layer_frame(layers=[[0, LAYER_BYTES, s[0]], [0, LAYER_BYTES, s[0]]])],
         grpc.StatusCode.INVALID_ARGUMENT, "duplicate layer 0"),
        (lambda b, s: [layer_frame(layers=[[7, LAYER_BYTES, 0]])],
         grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
        (lambda b, s: [layer_frame(layers=[[0, LAYER_BYTES, s[0] ^ 1]])],
         grpc.StatusCode.DATA_LOSS, "checksum mismatch in layer 0"),
        (lambda b, s: [layer_frame(layers=[[i, LAYER_BYTES, v] for i, v in enumerate(s[:3])])],
         grpc.StatusCode.DATA_LOSS, "truncated"),
    ],
    ids=["empty", "too-many", "short-entry", "bool-checksum", "not-a-list", "duplicate",
         "unknown-layer", "bad-checksum", "layer-missing"],
)
def test_broken_shm_announcements_fail_with_a_reason(
    receivers: dict[str, Any], announce: Any, code: grpc.StatusCode, reason: str
) -> None:
    rx, tid = receivers["shm"], f"shm-hostile-{uuid.uuid4().hex[:6]}"
    result = shm_raw(rx.address, tid, kv_layers(46), announce)
    assert isinstance(result, grpc.RpcError), result
    assert result.code() is code and reason in (result.details() or ""), result
    assert rx.state(tid) is ReceiveState.FAILED and rx.take(tid) is None
    rx.discard(tid)
    assert_still_serves(rx, "shm")


def test_shm_falls_back_to_the_network_when_the_receiver_has_it_off() -> None:
    with receiver_and_shm_sender(dataclasses.replace(CFG, shm=False)) as (rx, tx):
        layers = kv_layers(40)
        send_all(tx, rx.address, "shm-off", layers)
        outcome = wait_outcome(tx.fallback, "shm-off")  # the network sender reports it
        assert outcome.ok and tx.poll_finished() == []
        [(peer, reason, detail)] = tx.poll_fallbacks()
        assert (peer, reason) == (rx.address, "receiver_refuses_shm") and "UNIMPLEMENTED" in detail
        got = rx.take("shm-off")
        assert got is not None and same_bits(got.layers, layers)


def test_a_transfer_released_while_its_segment_is_mapped_is_refused_not_moved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The receiver releases the transfer (its request was cancelled) after lending the
    # segment and before the sender maps it; the release unlinked the segment, so the map
    # fails. The sender must report the refusal: not move the transfer to the network
    # (which refuses it too) nor stop using shm towards a healthy receiver.
    tid = "shm-released-at-map"
    real_segment = ShmKVSender._segment

    def released_first(self: ShmKVSender, *args: Any, **kwargs: Any) -> torch.Tensor:
        rx.discard(tid)
        return real_segment(self, *args, **kwargs)

    with receiver_and_shm_sender(CFG) as (rx, tx):
        monkeypatch.setattr(ShmKVSender, "_segment", released_first)
        send_all(tx, rx.address, tid, kv_layers(48))
        outcome = wait_outcome(tx, tid)
        assert not outcome.ok and "released by the receiver" in (outcome.error or ""), outcome
        assert tx.poll_fallbacks() == [] and tx.fallback.poll_finished() == []
        monkeypatch.undo()
        layers = kv_layers(49)
        send_all(tx, rx.address, "shm-after-release", layers)
        assert wait_outcome(tx, "shm-after-release").ok and tx.poll_fallbacks() == []
        got = rx.take("shm-after-release")
        assert got is not None and same_bits(got.layers, layers)


def test_shm_segments_are_unlinked_on_close_and_failed_ones_at_once() -> None:
    rx = make_receiver("grpc", RX_ID, CFG, "127.0.0.1", 0)
    tx = new_sender("shm")
    try:
        send_all(tx, rx.address, "seg-ok", kv_layers(41))
        assert wait_outcome(tx, "seg-ok").ok
        assert rx.take("seg-ok") is not None  # taken and never released: not reused
        first = rx.segments.names()
        assert len(on_disk(first)) == 1
        tx.begin(rx.address, spec_for("seg-fails"))
        tx.send_layer("seg-fails", 0, kv_layers(42)[0])
        wait_state(rx, "seg-fails", ReceiveState.RECEIVING, 5)
        both = rx.segments.names()
        assert len(on_disk(both)) == 2
        tx.cancel("seg-fails")
        wait_state(rx, "seg-fails", ReceiveState.FAILED, 2)
        assert on_disk(both) == first  # the failed one is unlinked, not pooled
    finally:
        tx.close()
        tx.fallback.close()
        rx.close()
    assert on_disk(both) == set()


def test_segments_of_a_dead_receiver_are_swept() -> None:
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=time.sleep, args=(0,))
    proc.start()
    proc.join(10)
    stale = shm_segments.SHM_DIR / f"{shm_segments.PREFIX}{proc.pid}-0"
    stale.write_bytes(b"\0" * 64)
    assert shm_segments.sweep_stale() >= 1 and not stale.exists()


# -- CUDA IPC offers on a host without a GPU (the device path: test_kv_cuda_ipc.py) -----------

GPU_CFG = dataclasses.replace(CFG, ipc_device="cuda:0")  # a sender whose engine is on a GPU


def full_device_staging(device: torch.device, nbytes: int) -> cuda_ipc.DeviceSlabs:
    """Device staging bounded below one transfer: its bookkeeping refuses before any
    device memory is touched, so CPU memory can stand in for the GPU's."""
    return cuda_ipc.DeviceSlabs(torch.device("cpu"), 1024)


@pytest.mark.parametrize("full", [False, True], ids=["receiver-without-a-gpu", "gpu-full"])
def test_a_cuda_ipc_offer_the_receiver_cannot_take_gets_a_host_segment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, full: bool
) -> None:
    if full:
        monkeypatch.setattr(grpc_receiver, "DeviceSlabs", full_device_staging)
    with receiver_and_shm_sender(GPU_CFG if full else CFG, GPU_CFG) as (rx, tx):
        layers = kv_layers(48)
        send_all(tx, rx.address, "ipc-offer", layers)
        assert wait_outcome(tx, "ipc-offer").ok and tx.poll_fallbacks() == []
        got = rx.take("ipc-offer")
        assert got is not None and same_bits(got.layers, layers)
        assert got.storage is not None and rx.segments.owns(got.storage)
        assert f"KV to {rx.address} goes through host shared memory" in caplog.text


class FakeCudaLender:
    """FAKE (protocol test only): lends host memory but describes it with the CUDA IPC
    fields given, as a receiver of another version or a hostile one might."""

    def __init__(self, fields: Any) -> None:
        self.pool, self.fields = SlabPool(torch.device("cpu"), 1 << 20), fields

    def get(self, nbytes: int) -> torch.Tensor:
        return self.pool.get(nbytes)

    def put(self, slab: torch.Tensor) -> None:
        self.pool.put(slab)

    def retire(self, slab: torch.Tensor) -> None:
        pass

    def describe(self, slab: torch.Tensor) -> dict[str, Any]:
        return {"cuda_ipc": self.fields, "checksum": cuda_ipc.DEVICE_CHECKSUM}


@pytest.mark.parametrize(("fields", "detail"), [
    ({"handle": "not base64!"}, "cuda_ipc.handle is not valid base64"),
    ("a string", "cuda_ipc must be an object"),
], ids=["bad-handle", "not-an-object"])
def test_a_slab_that_cannot_be_mapped_moves_the_transfer_to_the_network(
    monkeypatch: pytest.MonkeyPatch, fields: Any, detail: str
) -> None:
    monkeypatch.setattr(grpc_receiver, "DeviceSlabs", lambda device, nbytes: FakeCudaLender(fields))
    with receiver_and_shm_sender(GPU_CFG, GPU_CFG) as (rx, tx):
        layers = kv_layers(49)
        send_all(tx, rx.address, "ipc-bad", layers)
        assert wait_outcome(tx.fallback, "ipc-bad").ok  # the network sender delivered it
        [(peer, reason, why)] = tx.poll_fallbacks()
        assert (peer, reason) == (rx.address, "shm_setup_failed") and detail in why, why
        got = rx.take("ipc-bad")
        assert got is not None and same_bits(got.layers, layers)


# -- receiver hardening ------------------------------------------------------------------------


def silent(gate: threading.Event) -> Iterator[bytes]:
    """A stream's requests that send nothing until `gate` is set."""
    gate.wait(20)
    yield from ()


@pytest.mark.parametrize("method", [PUSH, PAIR, SHM])
def test_a_stream_without_a_header_is_cut_off(method: str) -> None:
    cfg = dataclasses.replace(CFG, header_timeout_s=0.5)
    rx = make_receiver("torch", RX_ID, cfg, "127.0.0.1", 0)
    gate = threading.Event()
    try:
        with grpc.insecure_channel(rx.address, options=channel_options(CFG)) as channel:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                if method == PUSH:
                    channel.stream_unary(method)(silent(gate), timeout=15)
                else:
                    list(channel.stream_stream(method)(silent(gate), timeout=15))
            took = time.monotonic() - t0
            gate.set()
        assert err.value.code() is grpc.StatusCode.CANCELLED and took < 10
        assert_still_serves(rx)
    finally:
        gate.set()
        rx.close()


def test_a_full_handler_pool_refuses_at_once_and_recovers() -> None:
    # Two handler threads, both held by streams that never send a header: a third
    # stream is refused RESOURCE_EXHAUSTED at once (not queued behind them), and once
    # the header deadline cuts the idle ones off the receiver serves again.
    cfg = dataclasses.replace(CFG, max_streams=2, header_timeout_s=3.0)
    rx = make_receiver("grpc", RX_ID, cfg, "127.0.0.1", 0)
    gate = threading.Event()
    try:
        with grpc.insecure_channel(rx.address, options=channel_options(CFG)) as channel:
            push = channel.stream_unary(PUSH)
            idle = [push.future(silent(gate), timeout=15) for _ in range(2)]
            time.sleep(0.5)  # both are being served (each holds a handler thread)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                push(silent(gate), timeout=15)
            took = time.monotonic() - t0
            codes = [f.exception().code() for f in idle]  # type: ignore[union-attr]
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert took < 1.0, f"refused after {took:.2f} s, not at once"
        assert codes == [grpc.StatusCode.CANCELLED] * 2  # cut off by the header deadline
        gate.set()
        assert_still_serves(rx)
    finally:
        gate.set()
        rx.close()
