"""What gloo itself moves on loopback: the floor under the torch.distributed transport.

Two processes on this host, a plain gloo process group, the same payload as
`kv_transport.py` (30 layers of (8, 3, 128, 128) fp32, 46 MB) sent layer by layer with
`send`/`recv` and a one-element reply, nothing else: no checksum, no control messages, no
staging. Compared with a one-thread torch memcpy of the same bytes, measured in the
sending process right after.

    python benchmarks/gloo_floor.py --rounds 10
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, SHAPE = 30, (8, 3, 128, 128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(rank: int, port: int, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    layers = [torch.randn(SHAPE) for _ in range(LAYERS)]
    reply = torch.zeros(1)
    times = []
    for _ in range(rounds + 2):  # the first two warm the connection up
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            for layer in layers:
                dist.send(layer, 1)
            dist.recv(reply, 1)
        else:
            for layer in layers:
                dist.recv(layer, 0)
            dist.send(reply, 0)
        times.append(time.perf_counter() - start)
    if rank == 0:
        src = torch.cat([layer.reshape(-1) for layer in layers])
        dst = torch.empty_like(src)
        copies = []
        for _ in range(rounds):
            start = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - start)
        moved, copied = statistics.median(times[2:]), statistics.median(copies)
        print(f"gloo send/recv of {src.numel() * 4 / 1e6:.0f} MB: median {moved * 1e3:.1f} ms; "
              f"memcpy {copied * 1e3:.1f} ms; {copied / moved:.2f}x memcpy")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (median shown)")
    args = parser.parse_args()
    mp.spawn(_run, args=(_free_port(), args.rounds), nprocs=2)


if __name__ == "__main__":
    main()
