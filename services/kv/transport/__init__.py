"""KV transports: move KV layers from prefill workers to decode workers.

`make_sender` / `make_receiver` pick an implementation by name:

* "grpc" (default): one gRPC client stream per transfer; works everywhere.
* "torch": payloads over a torch.distributed pair group (gloo for CPU tensors, NCCL for
  CUDA tensors), control over one gRPC stream per pair. A "torch" receiver also accepts
  "grpc" transfers.
* "shm" (same host only): through shared-memory segments the receiver owns; every
  receiver serves it too (unless its config turns shm off), on the same address.
"""

from __future__ import annotations

from services.kv.fingerprint import LayoutFingerprint, PeerIdentity
from services.kv.transport.base import KVReceiver, KVSender
from services.kv.transport.spec import (
    ReceivedKV,
    ReceiveState,
    TransferOutcome,
    TransferSpec,
    TransportConfig,
)

KINDS = ("grpc", "torch")  # network transports, named by decode workers
SHM = "shm"  # same-host transport, chosen by the producer (see make_shm_sender)

__all__ = [
    "KINDS",
    "KVReceiver",
    "KVSender",
    "LayoutFingerprint",
    "PeerIdentity",
    "ReceiveState",
    "ReceivedKV",
    "TransferOutcome",
    "TransferSpec",
    "TransportConfig",
    "make_receiver",
    "make_sender",
    "make_shm_sender",
]


def make_sender(kind: str, identity: PeerIdentity, config: TransportConfig) -> KVSender:
    """A sender of the given kind ("grpc" or "torch")."""
    # Imports are local so that importing the interface never pulls in grpc or c10d.
    if kind == "grpc":
        from services.kv.transport.grpc_sender import GrpcKVSender

        return GrpcKVSender(identity, config)
    if kind == "torch":
        from services.kv.transport.torch_sender import TorchDistSender

        return TorchDistSender(identity, config)
    raise ValueError(f"unknown KV transport {kind!r}; expected one of {', '.join(KINDS)}")


def make_shm_sender(
    identity: PeerIdentity, config: TransportConfig, fallback: KVSender
) -> KVSender:
    """A same-host sender; transfers it cannot start over shared memory go to `fallback`."""
    from services.kv.transport.shm_sender import ShmKVSender

    return ShmKVSender(identity, config, fallback)


def make_receiver(
    kind: str, identity: PeerIdentity, config: TransportConfig, host: str, port: int
) -> KVReceiver:
    """A receiver of the given kind serving on host:port (port 0 picks a free port)."""
    if kind == "grpc":
        from services.kv.transport.grpc_receiver import GrpcKVReceiver

        return GrpcKVReceiver(identity, config, host, port)
    if kind == "torch":
        from services.kv.transport.torch_receiver import TorchDistReceiver

        return TorchDistReceiver(identity, config, host, port)
    raise ValueError(f"unknown KV transport {kind!r}; expected one of {', '.join(KINDS)}")
