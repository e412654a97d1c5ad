"""KV transports: move KV layers from prefill workers to decode workers.

`make_sender` / `make_receiver` pick an implementation by name:

* "grpc" (default): one gRPC client stream per transfer; works everywhere.
* "torch": payloads over a torch.distributed pair group (gloo for CPU tensors, NCCL for
  CUDA tensors), control over one gRPC stream per pair. A "torch" receiver also accepts
  "grpc" transfers.
* "nixl": one-sided NIXL (UCX) WRITEs into memory the receiver registered once, control
  and descriptors over one gRPC stream per transfer (see `nixl_receiver`). A "nixl"
  receiver also accepts "grpc" transfers, which is where a nixl sender sends a transfer
  NIXL cannot take.
* "shm" (same host only): through shared-memory segments the receiver owns; every
  receiver serves it too (unless its config turns shm off), on the same address.

The decode worker names its kind (`--kv-transport`); a prefill worker on the same host
still goes through shm unless shm is off (`--no-kv-shm`) on either side.

NIXL (the library vLLM, Dynamo, llm-d and SGLang move KV with; UCX underneath: NVLink,
RDMA, TCP, or cross-process memory access on one host):

* Each process has one NIXL agent (`nixl_agent.agent()`: UCX backend, no progress thread;
  UCX is driven by the threads that wait on it) and registers one arena with it at
  start, `pool_bytes` large, on the worker's GPU (`TransportConfig.gpu`) or in host
  memory: the receiver's staging, which senders write into, and the sender's source
  buffers, which it lends to the producer (`KVSender.layer_memory`) so that the
  producer's copy of each layer's blocks is the WRITE's source. Host memory registers as
  DRAM, GPU memory as VRAM; that choice, by the tensor's device, is the only difference
  between CPU and GPU.
* Per transfer, the HEADER/SEGMENT exchange on the receiver's gRPC server (internal mTLS)
  hands the sender a region of the receiver's arena, its agent metadata and a fresh tag;
  the sender then WRITEs each layer as the engine hands it over, with a notification,
  and announces it with its checksum on the stream. Epochs, fingerprints, released ids,
  leases, stalls and exactly-once outcomes are the staging table's, as for every
  transport. The checksum stays: UCX's data path is neither authenticated nor visible to
  pdserve, and a late WRITE of an abandoned transfer could land in a reused region (a
  failed transfer's regions are quarantined for a lease against that).
* A transfer NIXL cannot take (a receiver without it, a full arena) goes over gRPC,
  logged once per peer and reason and counted in `pdserve_kv_transport_fallbacks_total`
  (see `services.kv.stats`). A process without the nixl package refuses to start a nixl
  receiver or sender, saying what to install.
* Why NIXL is a transport under pdserve's one connector rather than vLLM's own
  NixlConnector: docs/kv-transports.md. VRAM registration runs only on a GPU machine
  (`make gpu-check`).

Between tensor-parallel layouts a transport moves pieces: each is a transfer of its own
(its id `tp_layout.piece_transfer_id`, its heads in `TransferSpec.head_start/head_stop`)
from one prefill rank's sender to one decode rank's receiver, so nothing here depends on
the two sides' sizes."""

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

KINDS = ("grpc", "torch", "nixl")  # network transports, named by decode workers
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
    """A sender of the given kind ("grpc", "torch" or "nixl")."""
    # Imports are local so that importing the interface never pulls in grpc or c10d.
    if kind == "grpc":
        from services.kv.transport.grpc_sender import GrpcKVSender

        return GrpcKVSender(identity, config)
    if kind == "torch":
        from services.kv.transport.torch_sender import TorchDistSender

        return TorchDistSender(identity, config)
    if kind == "nixl":
        from services.kv.transport.grpc_sender import GrpcKVSender
        from services.kv.transport.nixl_sender import NixlKVSender

        return NixlKVSender(identity, config, GrpcKVSender(identity, config))
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
    if kind == "nixl":
        from services.kv.transport.nixl_receiver import NixlKVReceiver

        return NixlKVReceiver(identity, config, host, port)
    raise ValueError(f"unknown KV transport {kind!r}; expected one of {', '.join(KINDS)}")
