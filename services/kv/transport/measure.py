"""Throughput of a KV transport between two processes on one host.

`measure_transport` moves one prefill's worth of KV layers from a sender in this process
to a receiver in a spawned process, round after round. A round runs from `begin()` until
the sender holds the receiver's ack, i.e. everything is received, verified and staged;
all layers are handed over at once (no model compute to overlap with), so what is timed
is the transport alone. The receiver returns each transfer's memory with `release()`, as
the decode connector does, and the last round's bytes are checked end to end with CRC-32.

"shm" is the same-host transport: the receiver is a gRPC receiver (which serves shm on
its address) and the sender a shm sender with a gRPC fallback. A sender that lends memory
for the layers (`layer_memory`: nixl's registered arena) gets them copied there first, as
the producer makes its private copy of each layer there; that copy, which the producer
makes for every transport, is not timed (its seconds are taken out of the round's time
and CPU). `measure_copy` and
`measure_checksums` time the references a transport is compared with: one copy of the
same bytes, and each checksum algorithm over them.

The receiver serves on loopback unless given a `host` address; with `netns` it first joins
that network namespace, so that the bytes cross a link between two hosts
(`benchmarks/kv_transport.py --netns`).

`pdserve plan profile` measures the planner's transports with this; so does
`benchmarks/kv_transport.py`, which prints and plots them.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import resource
import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from services.kv.fingerprint import LayoutFingerprint, PeerIdentity
from services.kv.transport import (
    TransferSpec,
    TransportConfig,
    checksum,
    cuda_ipc,
    make_receiver,
    make_sender,
    make_shm_sender,
)
from services.kv.transport.frames import byte_view

# Both ends present this layout; the numbers only have to agree between them.
FINGERPRINT = LayoutFingerprint("smollm2-135m", "float32", 128, 30, 3, 64, "bench", "bench")
TAKE_TIMEOUT_S = 60.0  # receiver: how long a round's transfer may take to complete
ACK_TIMEOUT_S = 120.0  # sender: how long to wait for a round's outcome


@dataclass(slots=True, frozen=True)
class TransportRun:
    """The timed rounds of one transport over one payload."""

    payload_bytes: int  # bytes moved per round
    times_s: list[float]  # each round, begin() -> the receiver's ack at the sender
    receiver_span_s: list[float]  # each round, first byte -> last byte at the receiver
    sender_cpu_s: float  # user+sys CPU of the sending process over all timed rounds
    receiver_cpu_s: float  # the same for the receiving process

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def gb_per_s(self) -> float:
        """Payload bytes over the median round time."""
        return self.payload_bytes / self.median_s / 1e9

    @property
    def sender_cpu_s_per_gb(self) -> float:
        return self.sender_cpu_s / self._gb_moved()

    @property
    def receiver_cpu_s_per_gb(self) -> float:
        return self.receiver_cpu_s / self._gb_moved()

    def _gb_moved(self) -> float:
        return self.payload_bytes / 1e9 * len(self.times_s)

    def as_dict(self) -> dict[str, Any]:
        """The raw measurements, as `benchmarks/kv_transport.py --json` writes them."""
        return {"times_s": list(self.times_s), "receiver_span_s": list(self.receiver_span_s),
                "sender_cpu_s": self.sender_cpu_s, "receiver_cpu_s": self.receiver_cpu_s}


def random_layers(count: int, shape: tuple[int, ...], dtype: torch.dtype,
                  device: str = "cpu") -> list[torch.Tensor]:
    """``count`` KV layers of random values, the payload of one transfer."""
    return [torch.randn(shape).to(dtype).to(device) for _ in range(count)]


def payload_bytes(layers: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in layers)


def cpu_seconds() -> float:
    """User+sys CPU seconds of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


CLONE_NEWNET = 0x40000000  # from <sched.h>


def enter_netns(name: str) -> None:
    """Move this thread (and the threads it starts from now on) into the network namespace
    `name` (as `ip netns add` names it); needs root."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)} "
                          "(run as root)")
    finally:
        os.close(fd)


def _receiver_main(kind: str, config: TransportConfig, conn: Connection,
                   host: str = "127.0.0.1", netns: str = "") -> None:
    """Child process: serve, and hand back each transfer's timing when asked."""
    if netns:  # before anything starts a thread or opens a socket
        enter_netns(netns)
    torch.set_num_threads(1)
    if config.ipc_device:
        torch.cuda.set_device(torch.device(config.ipc_device))
    rx_kind = "grpc" if kind == "shm" else kind
    rx = make_receiver(rx_kind, PeerIdentity("bench-decode", 1, FINGERPRINT), config,
                       host, 0)
    conn.send(rx.address)
    while True:
        msg = conn.recv()
        if msg[0] == "take":
            _, tid, verify = msg
            # Every receiver made here is a GrpcKVReceiver (or derived), which can wait.
            state = rx.wait(tid, TAKE_TIMEOUT_S)  # type: ignore[attr-defined]
            got = rx.take(tid)
            if got is None:
                conn.send({"ok": False, "state": state.value, "error": rx.error(tid)})
                continue
            crc = 0
            if verify:
                for layer in got.layers:
                    crc = zlib.crc32(byte_view(layer.cpu()), crc)
            conn.send({"ok": True, "span_s": got.last_byte_ts - got.first_byte_ts, "crc": crc})
            rx.release(got)  # as the connector does after copying the blocks out
        elif msg[0] == "cpu":
            conn.send(cpu_seconds())
        else:
            rx.close()
            conn.send("bye")
            return


def measure_transport(kind: str, layers: list[torch.Tensor], config: TransportConfig,
                      rounds: int, warmup: int, host: str = "127.0.0.1",
                      netns: str = "") -> TransportRun:
    """``warmup`` untimed rounds, then ``rounds`` timed ones, of ``kind`` ("grpc", "torch"
    or "shm") to a receiver in a spawned process, serving on `host` (in the network
    namespace `netns` where given); raises when a round fails."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(kind, config, child, host, netns),
                       daemon=True)
    proc.start()
    address = parent.recv()
    me = PeerIdentity("bench-prefill", 1, FINGERPRINT)
    if kind == "shm":
        sender = make_shm_sender(me, config, make_sender("grpc", me, config))
    else:
        sender = make_sender(kind, me, config)
    expected_crc = 0
    for layer in layers:
        expected_crc = zlib.crc32(byte_view(layer.cpu()), expected_crc)
    times: list[float] = []
    spans: list[float] = []
    tx_cpu_total, rx_cpu_total = 0.0, 0.0
    try:
        for i in range(warmup + rounds):
            tid = f"{kind}-{i}"
            spec = TransferSpec(
                tid, len(layers), tuple(layers[0].shape), layers[0].dtype, 1000, 1,
                FINGERPRINT.digest())
            verify = i == warmup + rounds - 1
            parent.send(("cpu",))
            rx_cpu0, tx_cpu0 = parent.recv(), cpu_seconds()
            t0 = time.monotonic()
            sender.begin(address, spec)
            sent, placed_s = _placed(sender.layer_memory(tid), layers)
            for idx, layer in enumerate(sent):
                sender.send_layer(tid, idx, layer)
            sender.end(tid)
            # Every sender made here is a SenderCore, whose poll can wait for the outcome.
            outcome = sender.poll_finished(wait_s=ACK_TIMEOUT_S)  # type: ignore[call-arg]
            elapsed = time.monotonic() - t0 - placed_s
            tx_cpu = cpu_seconds() - tx_cpu0 - placed_s
            if not outcome or not outcome[0].ok:
                raise RuntimeError(f"{kind} round {i} failed: {outcome}")
            parent.send(("take", tid, verify))
            got = parent.recv()
            parent.send(("cpu",))
            rx_cpu = parent.recv() - rx_cpu0
            if not got["ok"] or (verify and got["crc"] != expected_crc):
                raise RuntimeError(f"{kind} round {i}: receiver got {got}")
            if i >= warmup:
                times.append(elapsed)
                spans.append(got["span_s"])
                tx_cpu_total += tx_cpu
                rx_cpu_total += rx_cpu
    finally:
        sender.close()
        parent.send(("stop",))
        parent.recv()
        proc.join(10)
    return TransportRun(payload_bytes(layers), times, spans, tx_cpu_total, rx_cpu_total)


def _placed(memory: torch.Tensor | None,
            layers: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """The layers to hand over, and the seconds spent copying them into `memory` (the
    sender's, where it lends some: layer i at i * layer bytes), as the producer does."""
    if memory is None:
        return layers, 0.0
    t0 = time.monotonic()
    out, offset = [], 0
    for layer in layers:
        n = layer.numel() * layer.element_size()
        view = memory[offset : offset + n].view(layer.dtype).view(layer.shape)
        view.copy_(layer)
        out.append(view)
        offset += n
    _sync(str(memory.device))
    return out, time.monotonic() - t0


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def measure_copy(nbytes: int, rounds: int, device: str = "cpu") -> list[float]:
    """Seconds of each of ``rounds`` torch copies of ``nbytes`` on ``device`` (on the CPU,
    on this thread: set torch's thread count first)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def measure_checksums(layers: list[torch.Tensor], rounds: int) -> dict[str, list[float]]:
    """Seconds of each of ``rounds`` passes of every checksum algorithm over the whole
    payload, layer by layer, on this thread, after one untimed pass: the host algorithms
    over host copies of GPU layers, the GPU digest where the layers are."""
    views = [byte_view(t.cpu()) for t in layers]
    digests: dict[str, tuple[Callable[[Any], object], list[Any]]] = {
        name: (lambda v, name=name: checksum.digest(name, v), views)  # type: ignore[misc]
        for name in checksum.ALGORITHMS}
    if layers[0].is_cuda:
        digests[cuda_ipc.DEVICE_CHECKSUM] = (cuda_ipc.device_digest, list(layers))
    out: dict[str, list[float]] = {}
    for name, (digest, items) in digests.items():
        times = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            for item in items:
                digest(item)
            times.append(time.perf_counter() - t0)
        out[name] = times[1:]
    return out
