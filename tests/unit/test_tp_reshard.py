"""KV moved between tensor-parallel layouts on real tensors, bit for bit: a TP=1 engine's
per-layer KV (random bytes in vLLM's CPU shape), split over prefill ranks as vLLM's llama
splits it, moved by `kv_pieces` into decode ranks, must equal what each decode rank would
have computed itself: its own heads of the same KV."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.kv.reshard import assemble, place, take
from services.kv.tp_layout import kv_heads_per_rank, kv_pieces, rank_heads, receives_of

BLOCKS, BLOCK_SIZE, HEAD_SIZE = 3, 4, 8


def split(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each rank's KV tensor: its heads of the full one (replicas are copies)."""
    heads = full.shape[1]
    return [full[:, rank_heads(r, tp, heads).start:rank_heads(r, tp, heads).stop].clone()
            for r in range(tp)]


def valid(tp: int, heads: int) -> bool:
    return heads % tp == 0 if tp <= heads else tp % heads == 0


CASES = [(a, b, h) for a, b, h in itertools.product(range(1, 9), range(1, 9), (1, 2, 4, 8))
         if valid(a, h) and valid(b, h)]


@pytest.mark.parametrize(("a", "b", "heads"), CASES)
def test_every_decode_rank_gets_exactly_its_heads_bit_for_bit(a: int, b: int,
                                                             heads: int) -> None:
    gen = torch.Generator().manual_seed(a * 100 + b * 10 + heads)
    full = torch.randn(BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_SIZE, generator=gen)
    prefill = dict(enumerate(split(full, a)))
    expected = split(full, b)
    pieces = kv_pieces(a, b, heads)
    for d in range(b):
        # NaN where nothing was placed: a missed head cannot pass as equal
        dst = torch.full((BLOCKS, kv_heads_per_rank(b, heads), BLOCK_SIZE, 2 * HEAD_SIZE),
                         float("nan"))
        assemble(dst, receives_of(d, pieces), prefill)
        assert torch.equal(dst, expected[d]), f"decode rank {d}"


def test_only_the_shipped_blocks_move() -> None:
    full = torch.arange(5 * 2 * 2 * 4, dtype=torch.float32).reshape(5, 2, 2, 4)
    prefill = dict(enumerate(split(full, 1)))
    piece = receives_of(1, kv_pieces(1, 2, 2))[0]
    ids = torch.tensor([4, 1])
    dst = torch.zeros(2, 1, 2, 4)
    place(dst, piece, take(prefill[0].index_select(0, ids), piece))
    assert torch.equal(dst, full[ids][:, 1:2])


def test_a_piece_of_the_wrong_shape_is_refused() -> None:
    piece = kv_pieces(1, 1, 2)[0]
    with pytest.raises(ValueError, match="has shape"):
        place(torch.zeros(1, 2, 2, 4), piece, torch.zeros(1, 2, 2, 8))
