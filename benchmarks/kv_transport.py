"""Throughput of the KV transports between two processes on one host.

Moves one prefill's worth of KV (default: 30 layers x (8, 3, 128, 128) fp32 = 47 MB,
about 1000 tokens of SmolLM2-135M) from a sender in this process to a receiver in a
spawned process, over each transport, and compares with a 1-thread torch memcpy of the
same bytes measured in the same run. Time per round: `begin()` until the sender holds the
receiver's ack, i.e. everything is received, verified and staged. All layers are handed
over at once (no model compute to overlap with), so this is the transport alone.

    python benchmarks/kv_transport.py --rounds 5 --json kv-transport.json

"shm" is the same-host transport (the receiver is the same kind of gRPC receiver, which
serves shm on its address). Each checksum algorithm is also timed alone over the payload
(1 thread), and `--checksum` picks what the transports' senders compute. Both processes
run with tcmalloc in front where it is installed, as pdserve's CPU engines (and so their
KV receivers) do; `--allocator system` measures glibc's malloc.

`--device cuda` (a GPU host) puts the layers in GPU memory and gives both ends the GPU
as `ipc_device`, so "shm" runs device to device over CUDA IPC; the reference is then a
device-to-device copy on that GPU, and the GPU digest (sum64) joins the checksum table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

try:
    import services  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.config import preload_allocator
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

FP = LayoutFingerprint("smollm2-135m", "float32", 128, 30, 3, 64, "bench", "bench")


def with_tls(config: TransportConfig) -> TransportConfig:
    """`config` under internal mTLS, with a development CA made for this run (both ends
    present the same role's certificate: what is measured is the encryption)."""
    import dataclasses
    import tempfile

    from services.security import certs

    directory = Path(tempfile.mkdtemp(prefix="kv-tls-"))
    certs.init(directory)
    files = certs.internal_files(directory, "decode")
    return dataclasses.replace(config, tls_ca_file=str(files.ca),
                               tls_cert_file=str(files.cert), tls_key_file=str(files.key))


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def receiver_main(kind: str, config: TransportConfig, conn: Any) -> None:
    """Child process: serve, and hand back each transfer's timing when asked."""
    torch.set_num_threads(1)
    if config.ipc_device:
        torch.cuda.set_device(torch.device(config.ipc_device))
    rx_kind = "grpc" if kind == "shm" else kind
    rx = make_receiver(rx_kind, PeerIdentity("bench-decode", 1, FP), config, "127.0.0.1", 0)
    conn.send(rx.address)
    while True:
        msg = conn.recv()
        if msg[0] == "take":
            _, tid, verify = msg
            state = rx.wait(tid, 60.0)  # type: ignore[attr-defined]
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


def bench_memcpy(nbytes: int, rounds: int, device: str = "cpu") -> dict[str, Any]:
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
    return {"times_s": times}


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def bench_checksums(layers: list[torch.Tensor], rounds: int) -> dict[str, Any]:
    """Each algorithm over the whole payload, layer by layer, on this thread (the host
    algorithms over host copies of GPU layers, the GPU digest where the layers are)."""
    views = [byte_view(t.cpu()) for t in layers]
    digests: dict[str, Any] = {
        name: (lambda v, name=name: checksum.digest(name, v), views)
        for name in checksum.ALGORITHMS}
    if layers[0].is_cuda:
        digests[cuda_ipc.DEVICE_CHECKSUM] = (cuda_ipc.device_digest, layers)
    out: dict[str, Any] = {}
    for name, (digest, items) in digests.items():
        times = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            for item in items:
                digest(item)
            times.append(time.perf_counter() - t0)
        out[name] = {"times_s": times[1:]}
    return out


def bench_transport(
    kind: str, layers: list[torch.Tensor], config: TransportConfig, rounds: int, warmup: int
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(kind, config, child), daemon=True)
    proc.start()
    address = parent.recv()
    me = PeerIdentity("bench-prefill", 1, FP)
    if kind == "shm":
        sender = make_shm_sender(me, config, make_sender("grpc", me, config))
    else:
        sender = make_sender(kind, me, config)
    expected_crc = 0
    for layer in layers:
        expected_crc = zlib.crc32(byte_view(layer.cpu()), expected_crc)
    times, spans, tx_cpu_total, rx_cpu_total = [], [], 0.0, 0.0
    try:
        for i in range(warmup + rounds):
            tid = f"{kind}-{i}"
            spec = TransferSpec(
                tid, len(layers), tuple(layers[0].shape), layers[0].dtype, 1000, 1, FP.digest()
            )
            verify = i == warmup + rounds - 1
            parent.send(("cpu",))
            rx_cpu0, tx_cpu0 = parent.recv(), cpu_seconds()
            t0 = time.monotonic()
            sender.begin(address, spec)
            for idx, layer in enumerate(layers):
                sender.send_layer(tid, idx, layer)
            sender.end(tid)
            outcome = sender.poll_finished(wait_s=120.0)
            elapsed = time.monotonic() - t0
            tx_cpu = cpu_seconds() - tx_cpu0
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
    return {
        "times_s": times,
        "receiver_span_s": spans,
        "sender_cpu_s": tx_cpu_total,
        "receiver_cpu_s": rx_cpu_total,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="KV transport throughput between two processes on loopback, "
        "against a 1-thread torch memcpy of the same bytes.",
        epilog="Columns: GB/s = payload bytes / median round time; x memcpy = ratio to the "
        "memcpy row; a round runs from begin() until the sender holds the receiver's ack "
        "(all bytes received, checksummed and staged); CPU s/GB = user+sys CPU seconds per "
        "GB moved, per process. The receiver returns each transfer's memory with release(), "
        "as the decode connector does. Numbers move with machine load (shown in the header).",
    )
    p.add_argument(
        "--transports",
        default="grpc,torch,shm",
        help="comma-separated transports to measure (default: grpc,torch,shm)",
    )
    p.add_argument("--layers", type=int, default=30, help="layers per transfer (default 30)")
    p.add_argument(
        "--shape",
        default="8,3,128,128",
        help="per-layer shape (blocks,kv_heads,block_size,2*head_size); default 8,3,128,128",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="KV dtype (default float32)",
    )
    p.add_argument(
        "--rounds", type=int, default=5, help="timed rounds; the median is shown (default 5)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=1 << 20,
        help="gRPC data frame payload size (default 1 MiB)",
    )
    p.add_argument(
        "--checksum",
        default=checksum.DEFAULT,
        choices=checksum.ALGORITHMS,
        help=f"what the senders compute (default {checksum.DEFAULT})",
    )
    p.add_argument("--tls", action="store_true",
                   help="also measure grpc and torch under internal mTLS (a CA made for the "
                   "run), each right after its plaintext run: the '+tls' rows")
    p.add_argument("--allocator", default="auto", choices=["auto", "tcmalloc", "system"],
                   help="malloc of both processes, as `pdserve --allocator` sets it for the "
                   "engines (whose worker process runs the KV receiver): auto = tcmalloc where "
                   "installed (default auto)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the layers live: cuda (a GPU host) sends them from GPU memory "
                   "and runs shm device to device over CUDA IPC; the reference is then a "
                   "copy on the GPU (default cpu)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here")
    preload = os.environ.get("LD_PRELOAD", "")
    wanted = preload_allocator(args.allocator, preload)
    if wanted != preload:  # start again with the allocator in front, as the engines do
        os.environ["LD_PRELOAD"] = wanted
        rest = sys.argv[1:] if argv is None else argv
        os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), *rest])
    allocator = "tcmalloc" if "tcmalloc" in wanted else "glibc malloc"

    torch.set_num_threads(1)
    shape = tuple(int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    layers = [torch.randn(shape).to(dtype).to(device) for _ in range(args.layers)]
    nbytes = sum(t.numel() * t.element_size() for t in layers)
    config = TransportConfig(
        chunk_bytes=args.chunk_bytes,
        max_message_bytes=max(8 << 20, args.chunk_bytes + (1 << 20)),
        checksum=args.checksum,
        ipc_device=device if device != "cpu" else "",
    )

    results: dict[str, Any] = {"memcpy": bench_memcpy(nbytes, max(args.rounds, 5), device)}
    sums = bench_checksums(layers, max(args.rounds, 5))
    tls_config = with_tls(config) if args.tls else None
    for kind in args.transports.split(","):
        results[kind] = bench_transport(kind, layers, config, args.rounds, args.warmup)
        if tls_config is not None and kind in ("grpc", "torch"):
            results[f"{kind}+tls"] = bench_transport(kind, layers, tls_config, args.rounds,
                                                     args.warmup)

    ref = nbytes / statistics.median(results["memcpy"]["times_s"]) / 1e9
    gb_moved = nbytes / 1e9
    print(
        f"payload {nbytes / 1e6:.1f} MB: {args.layers} layers x {shape} {args.dtype}; "
        f"on {device}; median of {args.rounds} rounds; {allocator}; "
        f"load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores"
    )
    print(
        "| transport | GB/s | x memcpy | ms median | ms min | ms max | CPU s/GB sender "
        "| CPU s/GB receiver |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        med = statistics.median(r["times_s"])
        gbps = nbytes / med / 1e9
        r.update(median_s=med, gb_per_s=gbps, x_memcpy=gbps / ref)
        cpu = ["-", "-"]
        if "sender_cpu_s" in r:
            moved = gb_moved * len(r["times_s"])
            r["sender_cpu_s_per_gb"] = r["sender_cpu_s"] / moved
            r["receiver_cpu_s_per_gb"] = r["receiver_cpu_s"] / moved
            cpu = [f"{r['sender_cpu_s_per_gb']:.2f}", f"{r['receiver_cpu_s_per_gb']:.2f}"]
        reference = ("memcpy, torch copy_, 1 thread" if device == "cpu"
                     else f"memcpy, torch copy_ on {device}")
        label = reference if name == "memcpy" else name
        lo, hi = min(r["times_s"]) * 1e3, max(r["times_s"]) * 1e3
        print(
            f"| {label} | {gbps:.2f} | {gbps / ref:.2f} | {med * 1e3:.1f} | {lo:.1f} "
            f"| {hi:.1f} | {cpu[0]} | {cpu[1]} |"
        )
    print("\n| checksum (1 thread) | GB/s | x memcpy |\n| --- | --- | --- |")
    for name, r in sums.items():
        gbps = nbytes / statistics.median(r["times_s"]) / 1e9
        r.update(gb_per_s=gbps, x_memcpy=gbps / ref)
        print(f"| {name} | {gbps:.2f} | {gbps / ref:.2f} |")
    results["checksums"] = sums
    if args.json:
        meta = {
            "payload_bytes": nbytes,
            "layers": args.layers,
            "shape": list(shape),
            "dtype": args.dtype,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "chunk_bytes": args.chunk_bytes,
            "checksum": args.checksum,
            "allocator": allocator,
            "device": device,
            "torch": torch.__version__,
        }
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
