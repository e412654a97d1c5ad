"""One inbound transfer as the receiver stages it (`Staged`), where its memory comes from
(`Pool`), and the two ways a stream's transfer is turned away (`Refused` at the header,
`TransferFault` mid-way). The table that holds them is `staging.StagingTable`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.transport import checksum
from services.kv.transport.spec import ReceiveState, TransferSpec


class Pool(Protocol):
    """Where staging memory comes from: `SlabPool` (private) or `SegmentPool` (shared)."""

    def get(self, nbytes: int) -> torch.Tensor: ...

    def put(self, slab: torch.Tensor) -> None: ...

    def retire(self, slab: torch.Tensor) -> None: ...


class Refused(Exception):
    """The header was not accepted (incompatible peer, duplicate id, no room)."""


class NoStagingMemory(Refused):
    """The header was fine but its staging memory could not be had (a full device)."""


class TransferFault(Exception):
    """The transfer broke a rule mid-way; it is FAILED and the stream should stop.

    `data_loss` tells corrupt or missing bytes (checksum, truncation) from protocol
    violations, so the server can answer DATA_LOSS or INVALID_ARGUMENT.
    """

    def __init__(self, reason: str, data_loss: bool = False) -> None:
        super().__init__(reason)
        self.data_loss = data_loss


@dataclass(eq=False)
class Staged:
    """One inbound transfer. Only its owning stream writes `layers`."""

    spec: TransferSpec
    sender: PeerIdentity
    layers: list[torch.Tensor]
    views: list[memoryview | None]  # byte views of CPU layers, made on first write
    first_ts: float
    first_wall: float
    last_progress: float
    state: ReceiveState = ReceiveState.RECEIVING
    error: str | None = None
    filled: list[int] = field(default_factory=list)  # bytes received per layer
    next_chunk: list[int] = field(default_factory=list)  # expected chunk index per layer
    expires: float = 0.0  # COMPLETE / FAILED records are dropped after this
    last_wall: float = 0.0
    on_stall: Callable[[], None] | None = None  # stops the stream when the reaper fails it
    slab: torch.Tensor | None = None  # pooled memory under `layers`
    checksum: str = checksum.DEFAULT  # the algorithm the sender named in its header
    pool: Pool | None = None  # where `slab` came from and goes back to
    released: bool = False  # discarded by the receiver while it was still arriving
