"""The records both ends of a KV transport share: what a transfer carries, how it ended,
what a receiver hands over, and the tunables."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from services.kv.transport import checksum
from services.kv.transport.checksum import DEFAULT as DEFAULT_CHECKSUM


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """What one transfer carries; the receiver checks every frame against it."""

    transfer_id: str  # caller's key, unique among live transfers at the receiver
    num_layers: int
    layer_shape: tuple[int, ...]  # shape of each layer tensor, e.g. (blocks, heads, bs, 2*hs)
    dtype: torch.dtype
    num_tokens: int  # the prompt's length; its KV is in the blocks (informational here)
    receiver_epoch: int  # epoch of the receiver the sender expects; a stale one is refused
    receiver_fingerprint: str  # layout digest the sender expects the receiver to have
    # The LoRA adapter the KV was computed with ("" = the base model): the consumer
    # loads it only into a request that runs under the same adapter.
    lora: str = ""
    # The prompt block the payload's block 0 is: the blocks before it were left out (the
    # decode worker holds them in its prefix cache). The consumer refuses a transfer
    # whose first block is not the one its request expects.
    first_block: int = 0
    # The model's KV heads [head_start, head_stop) the payload holds, in that order along
    # its head axis: a piece of a transfer between tensor-parallel layouts
    # (`tp_layout.kv_pieces`). (0, 0): every head of a sender at TP=1.
    head_start: int = 0
    head_stop: int = 0

    def __post_init__(self) -> None:
        if not self.transfer_id or len(self.transfer_id) > 256:
            raise ValueError("transfer_id must be 1..256 characters")
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        if not self.layer_shape or any(d <= 0 for d in self.layer_shape):
            raise ValueError(f"layer_shape must have positive dims, got {self.layer_shape}")
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {self.num_tokens}")
        if self.first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {self.first_block}")
        if not 0 <= self.head_start <= self.head_stop:
            raise ValueError(f"heads {self.head_start}..{self.head_stop} are not a range")

    @property
    def layer_nbytes(self) -> int:
        return math.prod(self.layer_shape) * self.dtype.itemsize

    @property
    def total_nbytes(self) -> int:
        return self.layer_nbytes * self.num_layers


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """Sender-side result of one transfer, reported once by `KVSender.poll_finished()`."""

    transfer_id: str
    ok: bool  # True only if the receiver acknowledged all bytes
    error: str | None  # why it failed (refusal reason, peer fault, cancel, ...)
    nbytes: int  # payload bytes the receiver acknowledged (0 unless ok)


@dataclass(slots=True)
class ReceivedKV:
    """A complete transfer handed over by `KVReceiver.take()`; the caller owns the tensors."""

    spec: TransferSpec
    layers: list[torch.Tensor]  # one tensor per layer, shape spec.layer_shape, spec.dtype
    nbytes: int
    first_byte_ts: float  # time.monotonic() when the header arrived
    last_byte_ts: float  # time.monotonic() when the last payload byte was verified
    first_byte_wall: float = 0.0  # the same two instants as time.time(), for cross-host logs
    last_byte_wall: float = 0.0
    chunks: int = 0  # payload pieces received (gRPC data frames; whole layers otherwise)
    checksum_s: float = 0.0  # time spent verifying their checksums
    sender_worker_id: str = ""
    storage: torch.Tensor | None = None  # the staging slab `layers` view; see release()


class ReceiveState(enum.Enum):
    UNKNOWN = "unknown"  # never seen, taken, discarded, or expired
    RECEIVING = "receiving"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """Tunables shared by both ends; the defaults suit one host or a LAN."""

    chunk_bytes: int = 1 << 20  # payload bytes per gRPC data frame
    max_message_bytes: int = 8 << 20  # gRPC max send/receive message, set on both ends
    lease_s: float = 30.0  # complete-but-untaken transfers are dropped after this
    stall_timeout_s: float = 10.0  # a transfer with no progress for this long -> FAILED
    # Layers queued at the sender per receiver, not yet taken by the network; when they
    # are all taken, send_layer waits up to send_block_s for one to go (it runs inside the
    # engine's forward pass, so a longer wait would stall every request of the engine),
    # then fails that transfer, and fails new ones to that receiver at once until it
    # takes a layer again: a hung receiver costs its own transfers, not the engine.
    send_queue_depth: int = 256
    send_block_s: float = 0.5
    max_streams: int = 32  # concurrent inbound streams (transfers + torch pairs) served
    max_staged_bytes: int = 8 << 30  # receiver refuses new transfers beyond this staging
    device: str = "cpu"  # where the receiver stages layers ("cuda:N" for the NCCL path)
    pool_bytes: int = 1 << 30  # staging memory kept for reuse: fresh pages cost page faults
    checksum: str = DEFAULT_CHECKSUM  # what this sender computes (see checksum.py)
    shm: bool = True  # receiver: accept same-host transfers through shared memory
    # This worker's GPU ("cuda:N"), set where its engine runs on one: same-host transfers
    # between two such workers go device to device over CUDA IPC (see cuda_ipc.py).
    ipc_device: str = ""
    # This worker's GPU ("cuda:N") where its engine runs on one, whatever shm says: the
    # nixl transport registers its arena there (VRAM), else in host memory (DRAM).
    gpu: str = ""
    header_timeout_s: float = 10.0  # receiver: a stream without its first frame by then ends
    # Internal mTLS (PEM files; all three or none): the receiver then requires a client
    # certificate from this CA, and senders check the receiver's for `pdserve.internal`.
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file and self.tls_cert_file and self.tls_key_file)

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        if self.max_message_bytes < self.chunk_bytes + 4096:
            raise ValueError("max_message_bytes must exceed chunk_bytes plus frame headers")
        if self.lease_s <= 0 or self.stall_timeout_s <= 0:
            raise ValueError("lease_s and stall_timeout_s must be positive")
        if self.send_queue_depth <= 0 or self.max_streams <= 0:
            raise ValueError("send_queue_depth and max_streams must be positive")
        if self.send_block_s < 0:
            raise ValueError("send_block_s must not be negative")
        checksum.check(self.checksum)
