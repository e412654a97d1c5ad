"""The KV transport interface: how KV layers move from a prefill worker to a decode worker.

Roles (mirroring the two halves of the vLLM connector):

* `KVSender` lives in the prefill worker process. The connector calls `begin()`, then
  `send_layer()` once per layer from inside the forward pass, then `end()`. `send_layer`
  only queues the (private) tensor; background threads ship it, so the transfer overlaps
  the compute of later layers. Every begun transfer yields exactly one `TransferOutcome`
  from `poll_finished()`: ok only when the receiver acknowledged every byte.
* `KVReceiver` lives in the decode worker process and runs its own server. It stages
  incoming layers in private buffers; the connector polls `state()` and calls `take()`
  once the transfer is COMPLETE, then copies the blocks into its paged cache.

Neither side raises into the engine on bad input or peer faults: a fault turns the
transfer FAILED with a reason (`TransferOutcome.error`, `KVReceiver.error()`), is logged,
and the rest keeps working. A transfer is never exposed partially.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from services.kv.transport.spec import ReceivedKV, ReceiveState, TransferOutcome, TransferSpec


class KVSender(ABC):
    """Ships transfers to receivers. One per process; thread-safe; never raises on faults."""

    @abstractmethod
    def begin(self, peer_address: str, spec: TransferSpec) -> None:
        """Start a transfer to the receiver at "host:port"; returns at once."""

    @abstractmethod
    def send_layer(self, transfer_id: str, layer_idx: int, tensor: torch.Tensor) -> None:
        """Queue one layer (a private tensor the sender may keep); returns at once.

        Blocks only while `send_queue_depth` layers to the same receiver are already
        queued (backpressure), and never longer than `send_block_s`: then the transfer
        fails instead, and so do new ones to that receiver until it takes a layer again.
        """

    @abstractmethod
    def end(self, transfer_id: str) -> None:
        """All layers have been handed over; the receiver acks once it has them all."""

    @abstractmethod
    def cancel(self, transfer_id: str) -> None:
        """Abandon a transfer; the receiver drops it; its outcome is ok=False."""

    @abstractmethod
    def poll_finished(self) -> list[TransferOutcome]:
        """Outcomes known since the previous call, each transfer exactly once."""

    def layer_memory(self, transfer_id: str) -> torch.Tensor | None:
        """Memory the sender reads a begun transfer's layers from without copying them:
        flat bytes, `spec.total_nbytes` long, layer i at `i * spec.layer_nbytes`; None when
        it has none. A caller that makes its private layer copies there, and hands over
        views of exactly those slices, spares the sender its copy. The memory stays the
        sender's: it takes it back once the transfer is over, so the caller must not use
        it after the transfer's outcome (or its cancel)."""
        return None

    def corrupt_after_checksum(self, transfer_id: str) -> None:
        """Fault injection for tests and drills: flip one payload byte of this transfer
        after its checksum was computed, so the receiver must catch it."""
        raise NotImplementedError(f"{type(self).__name__} cannot inject faults")

    @abstractmethod
    def close(self) -> None:
        """Fail what is still in flight, stop threads, close channels."""


class KVReceiver(ABC):
    """Serves incoming transfers and stages them until taken. One per process."""

    address: str  # "host:port" actually bound

    @abstractmethod
    def state(self, transfer_id: str) -> ReceiveState:
        """Where a transfer stands."""

    @abstractmethod
    def error(self, transfer_id: str) -> str | None:
        """Why a FAILED transfer failed (None otherwise)."""

    @abstractmethod
    def take(self, transfer_id: str) -> ReceivedKV | None:
        """Return a COMPLETE transfer and forget it; None in any other state."""

    @abstractmethod
    def discard(self, transfer_id: str) -> None:
        """Drop a transfer in any state (a RECEIVING one fails and stops being staged);
        for one lease a transfer with this id is refused."""

    @abstractmethod
    def staged(self) -> tuple[int, int]:
        """(transfers, bytes) held in staging now, in any state."""

    def release(self, kv: ReceivedKV) -> None:
        """Give a taken transfer's memory back for reuse, once its layers were copied out.

        Optional (unreleased memory is simply freed), but reused staging memory is already
        paged in, which makes receiving markedly cheaper. `kv.layers` must not be used
        afterwards: the next transfer may overwrite them.
        """
        kv.layers, kv.storage = [], None

    @abstractmethod
    def close(self) -> None:
        """Stop serving and free staged memory."""
