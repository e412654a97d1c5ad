"""KV transport over torch.distributed point-to-point: payload on a 2-rank pair group.

Per (sender, receiver) pair there is one process group and one bidirectional gRPC
control stream (method Pair). The stream carries HELLO/READY (rendezvous: the receiver
hosts a TCPStore on its own port and names a fresh key prefix for each pair, since stale
keys of an earlier pair would mislead the rendezvous), then HEADER, LAYER (size, checksum,
tag), END and CANCEL for any number of transfers, answered by ACK frames.

Why one control stream per pair rather than per transfer: a gloo send/recv pair must
agree on the size, or gloo kills the receiving process, and a pair group is driven by one
thread at a time on each side. With one ordered stream per pair, each side's single pair
thread meets every LAYER frame in the order the payloads travel, so the receiver always
posts a recv of exactly the announced size (a layer it cannot accept is drained into
scratch memory, which keeps the pair in step). Anything that breaks the stream or the
group fails the pair's transfers, and the next transfer builds a new pair.

CPU tensors use ProcessGroupGloo. CUDA tensors take the ProcessGroupNCCL branch, which
cannot run on a CPU-only machine and is untested; there the checksum is computed on a host
copy of each layer (correct, but it costs a device-to-host copy).
"""

from __future__ import annotations

import datetime
import re
import socket
from typing import Any

import torch
from torch.distributed import ProcessGroupGloo, Store

from services.kv.transport import checksum, frames

SEND_WINDOW = 2  # layers in flight per pair
DRAIN_LIMIT = 1 << 30  # a bad LAYER frame larger than this breaks the pair instead
TAG_MOD = 1 << 30
PAIR_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def local_ip_towards(host: str) -> str:
    """The local address this host uses to reach `host` (no packet is sent)."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def build_pair_group(store: Store, rank: int, hostname: str, device: str, timeout_s: float) -> Any:
    """A 2-rank group without global init; blocks until the other rank joins."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.device(device).type == "cuda":  # untested branch: needs two GPUs
        from torch.distributed import ProcessGroupNCCL

        nccl_opts = ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, 2, nccl_opts)
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=hostname)]
    opts._timeout = timeout
    return ProcessGroupGloo(store, rank, 2, opts)


def payload_checksum(algorithm: str, flat: torch.Tensor) -> int:
    """The checksum of a flat uint8 tensor (over a host copy for CUDA tensors)."""
    host = flat if flat.device.type == "cpu" else flat.cpu()
    return checksum.digest(algorithm, frames.byte_view(host))


def host_and_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
