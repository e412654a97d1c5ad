"""The nixl KV transport with real NIXL agents (UCX) in separate processes: the decode
side's receiver in a spawned process, the prefill side's sender in the test process (or
the other way round where the sender is the one that dies).

Every case ends in exactly one outcome at the sender and one state at the receiver, and
with every registered region free again on both sides: at once after a success, after
the quarantine (the lease) after a failure, since a one-sided WRITE may still land.
The cases the other transports share (refusals, stalls, cancel, corruption, two
concurrent transfers, a killed sender) run with nixl in test_kv_transport.py.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from services.kv.metadata import PdserveConnectorMetadata, SaveJob
from services.kv.producer import Producer
from services.kv.transport import (
    ReceiveState,
    TransferOutcome,
    checksum,
    frames,
    make_receiver,
    make_sender,
)
from services.kv.transport.frames import FrameKind
from services.kv.transport.grpc_channel import SERVICE, channel_options
from services.kv.transport.nixl_agent import agent
from services.kv.transport.nixl_receiver import NixlKVReceiver
from services.kv.transport.nixl_sender import NIXL, NixlKVSender
from tests.integration.test_kv_transport import (
    CFG,
    FP,
    LAYER_BYTES,
    LAYERS,
    RX_ID,
    SHAPE,
    TX_ID,
    kv_layers,
    same_bits,
    send_all,
    spec_for,
    wait_state,
)

pytestmark = pytest.mark.timeout(240)  # spawned processes import torch and nixl

LEASE_S = 1.5  # also the quarantine of a failed transfer's regions
NCFG = dataclasses.replace(CFG, lease_s=LEASE_S, pool_bytes=8 << 20)


def outcomes_of(sender: Any, tid: str, timeout: float) -> list[TransferOutcome]:
    """Every outcome reported for `tid` within `timeout`, then a while longer: exactly one
    is the contract."""
    got: list[TransferOutcome] = []
    deadline = time.monotonic() + timeout
    while not got and time.monotonic() < deadline:
        got += [o for o in sender.poll_finished(wait_s=0.1) if o.transfer_id == tid]
    time.sleep(0.3)
    got += [o for o in sender.poll_finished() if o.transfer_id == tid]
    return got


def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def sender_freed(tx: NixlKVSender) -> None:
    eventually(
        lambda: tx.arena.free_bytes == tx.arena.nbytes,
        LEASE_S + 3.0,
        "the sender's source region was not freed",
    )


# -- a receiver in a process of its own ---------------------------------------------------


def receiver_main(conn: Any) -> None:
    """The decode side, driven over a pipe; module-level so "spawn" can import it."""
    torch.set_num_threads(1)
    rx = make_receiver("nixl", RX_ID, NCFG, "127.0.0.1", 0)
    assert isinstance(rx, NixlKVReceiver)
    conn.send(rx.address)
    while True:
        msg = conn.recv()
        if msg[0] == "state":
            conn.send((rx.state(msg[1]).value, rx.error(msg[1])))
        elif msg[0] == "take":  # ("take", tid, seed): bit-exact against kv_layers(seed)?
            got = rx.take(msg[1])
            exact = got is not None and same_bits(got.layers, kv_layers(msg[2]))
            if got is not None:
                rx.release(got)
            conn.send(exact)
        elif msg[0] == "free":  # every region free and nothing staged?
            conn.send(rx.arena.free_bytes == rx.arena.nbytes and rx.staged() == (0, 0))
        else:
            rx.close()
            conn.send("bye")
            return


class RemoteReceiver:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(child,), daemon=True)
        self.proc.start()
        assert self.conn.poll(200), "the receiver process did not start"
        self.address: str = self.conn.recv()

    def ask(self, *msg: Any) -> Any:
        self.conn.send(msg)
        assert self.conn.poll(30), f"the receiver did not answer {msg}"
        return self.conn.recv()

    def state(self, tid: str) -> ReceiveState:
        return ReceiveState(self.ask("state", tid)[0])

    def wait_state(self, tid: str, state: ReceiveState, timeout: float) -> None:
        eventually(lambda: self.state(tid) is state, timeout, f"{tid} never {state.value}")

    def freed(self) -> None:
        eventually(
            lambda: self.ask("free"), LEASE_S + 3.0, "the receiver's staging region was not freed"
        )

    def stop(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)
            try:
                self.conn.send(("stop",))
                self.conn.poll(10)
            except OSError:  # a broken pipe: it is gone already
                pass
        self.proc.kill()
        self.proc.join(10)


@pytest.fixture
def remote() -> Iterator[RemoteReceiver]:
    rx = RemoteReceiver()
    yield rx
    rx.stop()


@pytest.fixture
def tx() -> Iterator[NixlKVSender]:
    sender = make_sender("nixl", TX_ID, NCFG)
    assert isinstance(sender, NixlKVSender)
    yield sender
    sender.close()


def test_success_is_bit_exact_and_frees_both_sides(
    remote: RemoteReceiver, tx: NixlKVSender
) -> None:
    for n in range(3):  # the first connects; later ones reuse the connection and regions
        tid = f"ok-{n}"
        send_all(tx, remote.address, tid, kv_layers(20 + n))
        [outcome] = outcomes_of(tx, tid, 20)
        assert outcome.ok and outcome.nbytes == LAYERS * LAYER_BYTES, outcome
        assert remote.ask("take", tid, 20 + n)
        assert tx.poll_fallbacks() == []  # it went over NIXL, not the gRPC fallback
        assert remote.ask("free")
        assert tx.arena.free_bytes == tx.arena.nbytes


def test_receiver_killed_mid_transfer(remote: RemoteReceiver, tx: NixlKVSender) -> None:
    tid, layers = "rx-killed", kv_layers(21)
    tx.begin(remote.address, spec_for(tid))
    tx.send_layer(tid, 0, layers[0])
    remote.wait_state(tid, ReceiveState.RECEIVING, 20)
    os.kill(remote.proc.pid, signal.SIGKILL)
    remote.proc.join(10)
    for i in range(1, LAYERS):
        tx.send_layer(tid, i, layers[i])
    tx.end(tid)
    [outcome] = outcomes_of(tx, tid, NCFG.stall_timeout_s + 10)
    assert not outcome.ok and outcome.error and outcome.nbytes == 0
    sender_freed(tx)


def test_receiver_that_never_answers(remote: RemoteReceiver, tx: NixlKVSender) -> None:
    os.kill(remote.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        send_all(tx, remote.address, "hung", kv_layers(22))
        [outcome] = outcomes_of(tx, "hung", NCFG.stall_timeout_s + 10)
        assert not outcome.ok and "no answer from the receiver" in (outcome.error or "")
        assert time.monotonic() - t0 < NCFG.stall_timeout_s + 5
        sender_freed(tx)
    finally:
        os.kill(remote.proc.pid, signal.SIGCONT)
    # Resumed, the receiver fails whatever it opened and frees its region, and serves.
    eventually(
        lambda: remote.state("hung") is not ReceiveState.RECEIVING,
        NCFG.stall_timeout_s + 5,
        "the receiver kept the hung transfer",
    )
    remote.freed()
    send_all(tx, remote.address, "after-hung", kv_layers(23))
    [ok] = outcomes_of(tx, "after-hung", 20)
    assert ok.ok and remote.ask("take", "after-hung", 23)


def test_cancel_while_in_flight(remote: RemoteReceiver, tx: NixlKVSender) -> None:
    tid, layers = "cancelled", kv_layers(24)
    tx.begin(remote.address, spec_for(tid))
    tx.send_layer(tid, 0, layers[0])
    tx.send_layer(tid, 1, layers[1])
    remote.wait_state(tid, ReceiveState.RECEIVING, 20)
    tx.cancel(tid)
    [outcome] = outcomes_of(tx, tid, 10)
    assert not outcome.ok and outcome.error == "cancelled by sender"
    remote.wait_state(tid, ReceiveState.FAILED, 5)
    assert not remote.ask("take", tid, 24)
    remote.freed()
    sender_freed(tx)


# -- a sender in a process of its own ----------------------------------------------------


def dying_sender(address: str, conn: Any) -> None:
    torch.set_num_threads(1)
    tx = make_sender("nixl", TX_ID, NCFG)
    tx.begin(address, spec_for("tx-killed"))
    for i, t in enumerate(kv_layers(25)[: LAYERS // 2]):
        tx.send_layer("tx-killed", i, t)
    conn.send("half sent")
    time.sleep(120)


def test_sender_killed_mid_transfer_frees_the_receivers_region() -> None:
    rx = make_receiver("nixl", RX_ID, NCFG, "127.0.0.1", 0)
    assert isinstance(rx, NixlKVReceiver)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=dying_sender, args=(rx.address, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(200) and parent.recv() == "half sent"
        wait_state(rx, "tx-killed", ReceiveState.RECEIVING, 20)
        os.kill(proc.pid, signal.SIGKILL)
        wait_state(rx, "tx-killed", ReceiveState.FAILED, NCFG.stall_timeout_s + 2)
        assert rx.take("tx-killed") is None
        eventually(
            lambda: rx.arena.free_bytes == rx.arena.nbytes,
            LEASE_S + 3,
            "the receiver's region was not freed",
        )
    finally:
        proc.kill()
        proc.join(10)
        rx.close()


# -- forged and stale descriptors ---------------------------------------------------------


def nixl_raw(
    address: str, tid: str, agent_name: str, act: Callable[[dict[str, Any], list[int]], list[bytes]]
) -> grpc.RpcError | bytes:
    """A Nixl stream driven by hand: HEADER naming `agent_name`, then the frames `act`
    returns for the SEGMENT's nixl offer and the layers' checksums, then END."""
    control: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    control.put(
        frames.encode_header(TX_ID, spec_for(tid), CFG.checksum, nixl={"agent": agent_name})
    )
    with grpc.insecure_channel(address, options=channel_options(CFG)) as channel:
        call = channel.stream_stream(NIXL)(iter(control.get, None), timeout=20)
        try:
            offer = frames.decode_frame(next(call)).body["nixl"]  # type: ignore[union-attr]
            sums = [checksum.digest(CFG.checksum, frames.byte_view(t)) for t in kv_layers(26)]
            for frame in act(offer, sums):
                control.put(frame)
            body = {"chunks": LAYERS, "nbytes": LAYERS * LAYER_BYTES}
            control.put(frames.encode_control(FrameKind.END, body))
            reply: bytes = next(call)
            return reply
        except grpc.RpcError as e:
            return e
        finally:
            control.put(None)


def write_layers(offer: dict[str, Any], note_tag: str) -> None:
    """WRITE kv_layers(26) into the offered region with this process's real agent,
    each with a notification under `note_tag`."""
    me = agent()
    src = torch.cat([t.reshape(-1).view(torch.uint8) for t in kv_layers(26)])
    reg = me.nixl.register_memory([src])
    try:
        if offer["agent"] != me.name:
            assert me.remote(base64.b64decode(offer["metadata"]), offer["agent"])
        for i in range(LAYERS):
            local = me.descs([(src.data_ptr() + i * LAYER_BYTES, LAYER_BYTES, 0)], "DRAM")
            remote = me.descs([(offer["addr"] + i * LAYER_BYTES, LAYER_BYTES, 0)], "DRAM")
            assert (
                me.write(local, remote, offer["agent"], f"{note_tag}:{i}".encode(), lambda: True)
                is None
            )
    finally:
        me.nixl.deregister_memory(reg)


def announce_all(sums: list[int]) -> list[bytes]:
    layers = [[i, LAYER_BYTES, v] for i, v in enumerate(sums)]
    return [frames.encode_control(FrameKind.LAYER, {"layers": layers})]


@pytest.mark.parametrize("forgery", ["other-agent", "stale-tag"])
def test_notifications_that_are_not_the_transfers_own_are_refused(
    remote: RemoteReceiver, forgery: str
) -> None:
    """The data lands and the checksums match, but the notifications come from an agent
    the HEADER did not name, or under another transfer's tag: the receiver does not
    take the layers as written, and the transfer fails with its region freed."""
    tid, me = f"forged-{forgery}", agent()
    named = "pdserve-someone-else" if forgery == "other-agent" else me.name

    def act(offer: dict[str, Any], sums: list[int]) -> list[bytes]:
        write_layers(offer, offer["tag"] if forgery == "other-agent" else uuid.uuid4().hex)
        return announce_all(sums)

    reply = nixl_raw(remote.address, tid, named, act)
    assert isinstance(reply, grpc.RpcError), reply
    assert reply.code() is grpc.StatusCode.DATA_LOSS
    assert "sent no NIXL notification" in (reply.details() or "")
    assert remote.state(tid) is ReceiveState.FAILED
    remote.freed()


def test_an_honest_hand_driven_stream_is_taken(remote: RemoteReceiver) -> None:
    """The control for the two forgeries: the same hand-driven stream, done right."""

    def act(offer: dict[str, Any], sums: list[int]) -> list[bytes]:
        write_layers(offer, offer["tag"])
        return announce_all(sums)

    reply = nixl_raw(remote.address, "honest", agent().name, act)
    assert isinstance(reply, bytes), reply
    assert remote.ask("take", "honest", 26)
    remote.freed()


class FakeReceiver:
    """A gRPC server whose Nixl method answers every HEADER with `offer` as its region:
    a forged or stale descriptor, delivered over the control channel."""

    def __init__(self, offer: dict[str, Any]) -> None:
        self.offer = offer
        self.server = grpc.server(ThreadPoolExecutor(4))
        handler = grpc.stream_stream_rpc_method_handler(self._nixl)
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, {"Nixl": handler})]
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _nixl(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        next(requests)
        body = {"nixl": self.offer, "nbytes": LAYERS * LAYER_BYTES}
        yield frames.encode_control(FrameKind.SEGMENT, body)
        for _ in requests:  # LAYER frames would mean the WRITE went through
            context.abort(grpc.StatusCode.INTERNAL, "a forged region was written")


def test_a_forged_or_stale_region_fails_the_transfer_once(
    remote: RemoteReceiver, tx: NixlKVSender
) -> None:
    # A real receiver's offer, captured, then bent: outside its registered memory, or
    # replayed after that receiver is gone.
    captured: dict[str, Any] = {}

    def capture(offer: dict[str, Any], sums: list[int]) -> list[bytes]:
        captured.update(offer)
        return []

    nixl_raw(remote.address, "capture", agent().name, capture)
    cases = {
        "outside": {**captured, "addr": captured["addr"] + (64 << 20)},
        "unregistered-agent": {**captured, "agent": "pdserve-nobody"},
    }
    for name, offer in cases.items():
        fake = FakeReceiver(offer)
        try:
            tid = f"forged-{name}"
            send_all(tx, fake.address, tid, kv_layers(27))
            [outcome] = outcomes_of(tx, tid, NCFG.stall_timeout_s + 10)
            assert not outcome.ok and outcome.error, outcome
        finally:
            fake.server.stop(0)
    os.kill(remote.proc.pid, signal.SIGKILL)  # now every captured descriptor is stale
    remote.proc.join(10)
    fake = FakeReceiver(captured)
    try:
        send_all(tx, fake.address, "stale", kv_layers(28))
        [outcome] = outcomes_of(tx, "stale", NCFG.stall_timeout_s + 10)
        assert not outcome.ok and outcome.error, outcome
    finally:
        fake.server.stop(0)
    sender_freed(tx)


def test_ends_made_inside_inference_mode_work_outside_it() -> None:
    """vLLM makes the connector's sender inside the forward pass, under
    torch.inference_mode; the sender's thread then writes its arena outside it."""
    with torch.inference_mode():
        rx = make_receiver("nixl", RX_ID, NCFG, "127.0.0.1", 0)
        tx = make_sender("nixl", TX_ID, NCFG)
        layers = kv_layers(29)
    try:
        send_all(tx, rx.address, "inference-mode", layers)
        [outcome] = outcomes_of(tx, "inference-mode", 20)
        assert outcome.ok, outcome
        got = rx.take("inference-mode")
        assert got is not None and same_bits(got.layers, layers)
    finally:
        tx.close()
        rx.close()


def test_a_full_receiver_arena_sends_the_transfer_over_grpc() -> None:
    """A receiver whose registered arena has no room for a transfer answers before any
    byte moved; the sender hands that transfer to gRPC, which delivers it."""
    small = dataclasses.replace(NCFG, pool_bytes=LAYER_BYTES)  # less than one transfer
    rx = make_receiver("nixl", RX_ID, small, "127.0.0.1", 0)
    tx = make_sender("nixl", TX_ID, NCFG)
    assert isinstance(tx, NixlKVSender)
    try:
        layers = kv_layers(30)
        send_all(tx, rx.address, "to-grpc", layers)
        [outcome] = outcomes_of(tx, "to-grpc", 20)
        assert outcome.ok, outcome
        got = rx.take("to-grpc")
        assert got is not None and same_bits(got.layers, layers)
        [(peer, reason, detail)] = tx.poll_fallbacks()
        assert (peer, reason) == (rx.address, "nixl_staging_full") and "arena full" in detail
        sender_freed(tx)
    finally:
        tx.close()
        rx.close()


def test_a_receiver_without_nixl_gets_the_transfer_over_grpc() -> None:
    rx = make_receiver("grpc", RX_ID, NCFG, "127.0.0.1", 0)
    tx = make_sender("nixl", TX_ID, NCFG)
    assert isinstance(tx, NixlKVSender)
    try:
        layers = kv_layers(31)
        send_all(tx, rx.address, "no-nixl-there", layers)
        [outcome] = outcomes_of(tx, "no-nixl-there", 20)
        assert outcome.ok, outcome
        got = rx.take("no-nixl-there")
        assert got is not None and same_bits(got.layers, layers)
        [(_, reason, _)] = tx.poll_fallbacks()
        assert reason == "receiver_refuses_nixl"
    finally:
        tx.close()
        rx.close()


# -- the producer's copies in registered memory, and fallbacks counted -------------------


def test_layers_made_in_lent_memory_are_sent_from_there_and_others_are_copied() -> None:
    """A layer handed over as a view of the region `layer_memory` lent is WRITten from
    there; one from elsewhere is copied into that region first; both arrive bit-exact."""
    rx = make_receiver("nixl", RX_ID, NCFG, "127.0.0.1", 0)
    tx = make_sender("nixl", TX_ID, NCFG)
    assert isinstance(tx, NixlKVSender)
    try:
        layers = kv_layers(32)
        tx.begin(rx.address, spec_for("lent"))
        memory = tx.layer_memory("lent")
        assert memory is not None and tx.arena.owns(memory)
        assert memory.numel() >= LAYERS * LAYER_BYTES
        for i, layer in enumerate(layers):
            if i % 2:  # from elsewhere
                tx.send_layer("lent", i, layer)
                continue
            view = memory[i * LAYER_BYTES : (i + 1) * LAYER_BYTES].view(torch.float32)
            view = view.view(layer.shape)
            view.copy_(layer)
            tx.send_layer("lent", i, view)
        tx.end("lent")
        [outcome] = outcomes_of(tx, "lent", 20)
        assert outcome.ok, outcome
        got = rx.take("lent")
        assert got is not None and same_bits(got.layers, layers)
        assert tx.layer_memory("lent") is None  # over: the region went back
        sender_freed(tx)
    finally:
        tx.close()
        rx.close()


def test_an_arena_too_small_for_a_whole_transfer_sends_layer_by_layer() -> None:
    """No room to lend a whole transfer's region: each layer is copied into a one-layer
    region and still goes over NIXL, not gRPC."""
    small = dataclasses.replace(NCFG, pool_bytes=2 * LAYER_BYTES)  # < LAYERS layers
    rx = make_receiver("nixl", RX_ID, NCFG, "127.0.0.1", 0)
    tx = make_sender("nixl", TX_ID, small)
    assert isinstance(tx, NixlKVSender)
    try:
        tx.begin(rx.address, spec_for("by-layer"))
        assert tx.layer_memory("by-layer") is None
        layers = kv_layers(33)
        for i, layer in enumerate(layers):
            tx.send_layer("by-layer", i, layer)
        tx.end("by-layer")
        [outcome] = outcomes_of(tx, "by-layer", 20)
        assert outcome.ok, outcome
        got = rx.take("by-layer")
        assert got is not None and same_bits(got.layers, layers)
        assert tx.poll_fallbacks() == []
        sender_freed(tx)
    finally:
        tx.close()
        rx.close()


def kv_caches(seed: int, blocks: int = 5) -> dict[str, torch.Tensor]:
    """A prefill engine's paged KV cache, one tensor per layer (vLLM's CPU layout)."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn((blocks, *SHAPE[1:]), generator=g)
        for i in range(LAYERS)
    }


def produce(
    producer: Producer, caches: dict[str, torch.Tensor], address: str, req: str
) -> None:
    """One prefill's save path: every layer's blocks 3 and 1, then wait until the
    producer reports the request's blocks free."""
    job = SaveJob(req, req, address, "nixl", RX_ID.epoch, FP.digest(), [3, 1], 30)
    meta = PdserveConnectorMetadata(saves=[job])
    for name, kv in caches.items():
        producer.save_kv_layer(meta, name, kv)
    eventually(lambda: producer.get_finished({req}) == {req}, 20, f"{req} never finished")


def test_the_producer_copies_into_registered_memory_and_counts_fallbacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Through the connector's producer: its copy of each layer's blocks is made in the
    nixl sender's registered arena (the WRITE's source, no second copy), and a transfer
    the sender hands to gRPC is counted by reason for `pdserve_kv_transport_fallbacks_total`
    and logged once per receiver and reason."""
    nixl_rx = make_receiver("nixl", RX_ID, NCFG, "127.0.0.1", 0)
    grpc_rx = make_receiver("grpc", RX_ID, NCFG, "127.0.0.1", 0)
    producer = Producer(TX_ID, NCFG, lease_s=30.0, allow_faults=False, shm=False)
    caches = kv_caches(34)
    producer.register_kv_caches(caches)
    want = [kv[[3, 1]] for kv in caches.values()]
    try:
        job = SaveJob("r0", "r0", nixl_rx.address, "nixl", RX_ID.epoch, FP.digest(), [3, 1], 30)
        meta = PdserveConnectorMetadata(saves=[job])
        first, *rest = caches.items()
        producer.save_kv_layer(meta, *first)
        sender = producer._senders["nixl"]
        assert isinstance(sender, NixlKVSender)
        copies = producer._sending["r0"].copies
        assert len(copies) == LAYERS and all(sender.arena.owns(c) for c in copies)
        assert producer._sending["r0"].slab is None  # nothing from the producer's own pool
        for name, kv in rest:
            producer.save_kv_layer(meta, name, kv)
        eventually(lambda: producer.get_finished({"r0"}) == {"r0"}, 20, "r0 never finished")
        got = nixl_rx.take("r0")
        assert got is not None and same_bits(got.layers, want)
        assert producer.take_fallbacks() == {}

        with caplog.at_level(logging.WARNING):
            for req in ("r1", "r2"):
                produce(producer, caches, grpc_rx.address, req)
                got = grpc_rx.take(req)
                assert got is not None and same_bits(got.layers, want)
        assert producer.take_fallbacks() == {"receiver_refuses_nixl": 2}
        assert producer.take_fallbacks() == {}
        told = [r for r in caplog.records if "not NIXL" in r.getMessage()]
        assert len(told) == 1 and grpc_rx.address in told[0].getMessage()
    finally:
        producer.close()
        nixl_rx.close()
        grpc_rx.close()
