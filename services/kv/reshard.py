"""Moving KV pieces between tensor-parallel layouts (`tp_layout.kv_pieces`) on tensors.

A KV page holds one (block, head): on CPU a layer's tensor is `[blocks, kv_heads,
block_size, 2*head_size]` and the packing inside a page (K transposed on AVX2) never
crosses heads, so a run of heads is a slice along the head axis that can be copied as
bytes from a prefill rank's tensor into a decode rank's, whatever the two TP sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from services.kv.tp_layout import KVPiece

if TYPE_CHECKING:
    import torch

# The head axis of vLLM's CPU KV tensor (`[blocks, kv_heads, block_size, 2*head_size]`).
CPU_HEAD_AXIS = 1


def take(src: torch.Tensor, piece: KVPiece, head_axis: int = CPU_HEAD_AXIS) -> torch.Tensor:
    """What a prefill rank sends for `piece`: its heads, from the rank's tensor `src` (or
    from the blocks of it being shipped). A view: copy it before the cache moves on."""
    return src.narrow(head_axis, piece.src.start, piece.src.count)


def place(dst: torch.Tensor, piece: KVPiece, data: torch.Tensor,
          head_axis: int = CPU_HEAD_AXIS) -> None:
    """Copy a received piece into a decode rank's tensor `dst` at its heads."""
    view = dst.narrow(head_axis, piece.dst.start, piece.dst.count)
    if view.shape != data.shape:
        raise ValueError(f"piece of heads {piece.head_start}-{piece.head_stop - 1} has shape "
                         f"{tuple(data.shape)}, its place {tuple(view.shape)}")
    view.copy_(data)


def assemble(dst: torch.Tensor, pieces: list[KVPiece], sources: Mapping[int, torch.Tensor],
             head_axis: int = CPU_HEAD_AXIS) -> None:
    """Fill a decode rank's tensor from the prefill ranks' tensors `sources` (by rank)."""
    for piece in pieces:
        place(dst, piece, take(sources[piece.src.rank], piece, head_axis), head_axis)
