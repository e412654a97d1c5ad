"""Throughput of the KV transports between two processes on one host: a command line over
`services.kv.transport.measure`, which says what a round times.

Moves one prefill's worth of KV (default: 30 layers x (8, 3, 128, 128) fp32 = 47 MB,
about 1000 tokens of SmolLM2-135M) over each transport, and compares with a 1-thread
torch memcpy of the same bytes measured in the same run.

    python benchmarks/kv_transport.py --rounds 5 --json kv-transport.json

Each checksum algorithm is also timed alone over the payload (1 thread), and `--checksum`
picks what the transports' senders compute. Both processes run with tcmalloc in front
where it is installed, as pdserve's CPU engines (and so their KV receivers) do;
`--allocator system` measures glibc's malloc.

"nixl" WRITEs each layer with NIXL (UCX) into memory the receiver registered once, from
the region of the sender's registered arena the producer copies the layers into (that
copy is the producer's own, made for every transport, and is not timed); on one host UCX
picks cross-process memory access where ptrace rules allow it, TCP otherwise (`UCX_TLS`
in the environment chooses).

`--netns` runs the two processes on two hosts instead of one: network namespaces on a
bridge (services/bench/netns.py; needs root and iproute2), the sender and the memcpy
reference in one, the receiver in the other serving on its own address, so every byte
crosses a veth link and the bridge as TCP. UCX would still reach the other process's
memory directly (both namespaces share one kernel), so nixl is held to TCP over the hosts'
link (`UCX_TLS=tcp`, `UCX_NET_DEVICES=eth0`) unless `UCX_TLS` is set already. Only
transports that work between hosts are accepted (not shm).

`--device cuda` (a GPU host) puts the layers in GPU memory and gives both ends the GPU
(as `ipc_device` and `gpu`), so "shm" runs device to device over CUDA IPC and "nixl"
registers GPU memory (VRAM) at both ends; the reference is then a
device-to-device copy on that GPU, and the GPU digest (sum64) joins the checksum table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

try:
    import services  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.config import preload_allocator
from services.kv.transport import TransportConfig, checksum
from services.kv.transport.measure import (
    measure_checksums,
    measure_copy,
    measure_transport,
    payload_bytes,
    random_layers,
)


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


def run_on_two_hosts(argv: list[str] | None) -> int:
    """This benchmark again, with the same arguments, in a "prefill" host of a fresh
    fabric of two, its receivers in the "decode" host serving on that host's address."""
    import subprocess

    from services.bench.netns import Fabric, unavailable

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"--netns: network namespaces are not available here: {reason}")
    rest = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--netns"]
    env = dict(os.environ)
    if "UCX_TLS" not in env:  # TCP over the link, as between two machines (see above)
        env.update(UCX_TLS="tcp", UCX_NET_DEVICES="eth0")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")) if p)
    fabric = Fabric.create(["prefill", "decode"])
    try:
        cmd = [*fabric.prefix("prefill"), sys.executable, str(Path(__file__).resolve()),
               *rest, "--receiver-netns", fabric.hosts["decode"].ns,
               "--receiver-host", fabric.addr("decode")]
        rc = subprocess.run(cmd, env=env).returncode
        # Read from outside the hosts: proof that the KV crossed the link, not memory.
        print(f"the decode host's link received {fabric.link_bytes('decode')[1] / 1e6:.0f} "
              "MB in all")
        return rc
    finally:
        fabric.close()


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
        default="grpc,torch,shm,nixl",
        help="comma-separated transports to measure (default: grpc,torch,shm,nixl; nixl "
        "needs the nixl package)",
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
    p.add_argument("--netns", action="store_true",
                   help="sender and receiver on two hosts (network namespaces on a bridge; "
                   "needs root): the KV crosses a link as TCP")
    # Set by --netns for the run inside the sender's host: the receiver's namespace and
    # address.
    p.add_argument("--receiver-netns", default="", help=argparse.SUPPRESS)
    p.add_argument("--receiver-host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.netns and "shm" in args.transports.split(","):
        p.error("--netns: shm moves KV within one host only; leave it out of --transports")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here")
    preload = os.environ.get("LD_PRELOAD", "")
    wanted = preload_allocator(args.allocator, preload)
    if wanted != preload:  # start again with the allocator in front, as the engines do
        os.environ["LD_PRELOAD"] = wanted
        rest = sys.argv[1:] if argv is None else argv
        os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), *rest])
    allocator = "tcmalloc" if "tcmalloc" in wanted else "glibc malloc"
    if args.netns:
        return run_on_two_hosts(argv)

    torch.set_num_threads(1)
    shape = tuple(int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    layers = random_layers(args.layers, shape, dtype, device)
    nbytes = payload_bytes(layers)
    config = TransportConfig(
        chunk_bytes=args.chunk_bytes,
        max_message_bytes=max(8 << 20, args.chunk_bytes + (1 << 20)),
        checksum=args.checksum,
        ipc_device=device if device != "cpu" else "",
        gpu=device if device != "cpu" else "",
    )

    results: dict[str, Any] = {
        "memcpy": {"times_s": measure_copy(nbytes, max(args.rounds, 5), device)}}
    sums: dict[str, Any] = {name: {"times_s": times} for name, times in
                            measure_checksums(layers, max(args.rounds, 5)).items()}
    tls_config = with_tls(config) if args.tls else None
    where = {"host": args.receiver_host, "netns": args.receiver_netns}
    for kind in args.transports.split(","):
        results[kind] = measure_transport(kind, layers, config, args.rounds,
                                          args.warmup, **where).as_dict()
        if tls_config is not None and kind in ("grpc", "torch"):
            results[f"{kind}+tls"] = measure_transport(kind, layers, tls_config, args.rounds,
                                                       args.warmup, **where).as_dict()

    ref = nbytes / statistics.median(results["memcpy"]["times_s"]) / 1e9
    gb_moved = nbytes / 1e9
    between = (f"between two hosts (receiver at {args.receiver_host}, UCX_TLS="
               f"{os.environ.get('UCX_TLS', 'default')})" if args.receiver_netns
               else "on loopback")
    print(
        f"payload {nbytes / 1e6:.1f} MB: {args.layers} layers x {shape} {args.dtype}; "
        f"on {device}; {between}; median of {args.rounds} rounds; {allocator}; "
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
            "receiver_host": args.receiver_host,
            "two_hosts": bool(args.receiver_netns),
            "ucx_tls": os.environ.get("UCX_TLS", ""),
            "torch": torch.__version__,
        }
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
