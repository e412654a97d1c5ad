"""KV heads over tensor-parallel ranks (services/kv/tp_layout.py): the mapping between a
prefill layout at TP=a and a decode layout at TP=b, checked for every pair up to 8x8 and
every KV-head count up to 8, against the ranks' tensors as vLLM's llama lays them out."""

from __future__ import annotations

import itertools

import pytest

from services.kv.tp_layout import (
    check_model_shape,
    holders,
    kv_heads_per_rank,
    kv_kind,
    kv_pieces,
    rank_heads,
    receives_of,
    sends_of,
    tp_problem,
)

TPS = range(1, 9)
KV_HEADS = range(1, 9)


def valid(tp: int, heads: int) -> bool:
    """vLLM's rule, written out independently: tp divides the heads, or the heads tp."""
    return heads % tp == 0 if tp <= heads else tp % heads == 0


def rank_tensor(rank: int, tp: int, heads: int) -> list[int]:
    """The global head at each position of a rank's KV tensor, as vLLM's
    QKVParallelLinear loads them: a contiguous shard, or head rank // replicas."""
    if tp <= heads:
        per = heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // heads)]


CASES = [(a, b, h) for a, b, h in itertools.product(TPS, TPS, KV_HEADS)
         if valid(a, h) and valid(b, h)]


def test_the_cases_cover_every_pair_up_to_8x8() -> None:
    # every (a, b) pair appears with at least one head count (1 KV head allows any TP)
    assert {(a, b) for a, b, _ in CASES} == set(itertools.product(TPS, TPS))
    assert len(CASES) > 64


@pytest.mark.parametrize(("a", "b", "heads"), CASES)
def test_every_decode_rank_gets_exactly_its_heads_from_ranks_that_hold_them(
        a: int, b: int, heads: int) -> None:
    pieces = kv_pieces(a, b, heads)
    prefill = [rank_tensor(p, a, heads) for p in range(a)]
    decode = [rank_tensor(d, b, heads) for d in range(b)]
    for d in range(b):
        filled = [0] * len(decode[d])
        for piece in receives_of(d, pieces):
            assert piece.src.count == piece.dst.count == piece.head_stop - piece.head_start
            assert 0 <= piece.src.start < piece.src.stop <= len(prefill[piece.src.rank])
            assert 0 <= piece.dst.start < piece.dst.stop <= len(decode[d])
            sent = prefill[piece.src.rank][piece.src.start:piece.src.stop]
            # the source holds what it sends, and it lands where the decode rank keeps it
            assert sent == list(range(piece.head_start, piece.head_stop))
            assert decode[d][piece.dst.start:piece.dst.stop] == sent
            for pos in range(piece.dst.start, piece.dst.stop):
                filled[pos] += 1
        assert filled == [1] * len(decode[d]), f"decode rank {d}: positions filled {filled}"
    # nothing is sent that no decode rank takes, and every piece is in some rank's list
    assert sum(len(sends_of(p, pieces)) for p in range(a)) == len(pieces)
    assert sum(len(receives_of(d, pieces)) for d in range(b)) == len(pieces)


@pytest.mark.parametrize(("a", "b", "heads"), CASES)
def test_pieces_are_whole_runs(a: int, b: int, heads: int) -> None:
    """One piece per (source, destination) run: as few sends as the layouts allow."""
    pieces = kv_pieces(a, b, heads)
    pairs = [(p.src.rank, p.dst.rank) for p in pieces]
    assert len(pairs) == len(set(pairs))


@pytest.mark.parametrize(("tp", "heads"), [(t, h) for t in TPS for h in (1, 2, 4, 8)
                                           if valid(t, h)])
def test_equal_layouts_move_each_rank_to_itself(tp: int, heads: int) -> None:
    pieces = kv_pieces(tp, tp, heads)
    per = kv_heads_per_rank(tp, heads)
    assert [(p.src, p.dst) for p in pieces] == [
        (s, s) for s in (p.dst for p in pieces)]
    assert sorted(p.dst.rank for p in pieces) == list(range(tp))
    assert all((p.dst.start, p.dst.stop) == (0, per) for p in pieces)


def test_replicated_heads_spread_the_sending_over_replicas() -> None:
    # 2 KV heads over 8 prefill ranks: 4 replicas of each; 4 decode ranks hold one head
    # each (2 replicas of each): decode ranks 0 and 1 (head 0) read different replicas.
    pieces = kv_pieces(8, 4, 2)
    assert [p.src.rank for p in pieces] == [0, 1, 6, 7]
    assert [p.head_start for p in pieces] == [0, 0, 1, 1]
    assert holders(1, 8, 2) == [4, 5, 6, 7]


def test_per_rank_heads_follow_vllm() -> None:
    assert kv_heads_per_rank(2, 2) == 1 and kv_heads_per_rank(1, 2) == 2
    assert kv_heads_per_rank(8, 2) == 1  # max(1, 2 // 8): replicated
    assert rank_heads(5, 8, 2) == range(1, 2)
    assert rank_heads(1, 2, 8) == range(4, 8)


@pytest.mark.parametrize(("tp", "heads", "says"), [
    (3, 2, "multiple of 2"), (3, 8, "must divide 8"), (6, 4, "multiple of 4"),
    (0, 2, ">= 1")])
def test_sizes_the_heads_do_not_allow_are_refused_in_words(tp: int, heads: int,
                                                          says: str) -> None:
    assert says in tp_problem(tp, heads)
    with pytest.raises(ValueError, match=says):
        kv_pieces(tp, 1, heads) if tp else kv_heads_per_rank(tp, heads)
    with pytest.raises(ValueError, match=says):
        kv_pieces(1, tp, heads) if tp else kv_heads_per_rank(tp, heads)


LLAMA = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}


def test_model_shape_checks() -> None:
    check_model_shape(LLAMA, 1, kv_transfer=True)
    check_model_shape(LLAMA, 2, kv_transfer=True)
    check_model_shape(LLAMA, 4, kv_transfer=False)  # KV heads replicated
    with pytest.raises(ValueError, match="4 attention heads do not split over 3"):
        check_model_shape(LLAMA, 3, kv_transfer=False)
    smollm = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3}
    with pytest.raises(ValueError, match="must divide 9"):
        check_model_shape(smollm, 2, kv_transfer=False)
    check_model_shape({}, 3, kv_transfer=True)  # unknown: left to vLLM


@pytest.mark.parametrize(("config", "kind"), [
    (LLAMA, "attention"),
    ({"model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention"]},
     "attention"),
    ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, "mla"),
    ({"model_type": "custom", "kv_lora_rank": 512}, "mla"),
    ({"model_type": "jamba"}, "hybrid"),
    ({"model_type": "custom", "layer_types": ["full_attention", "linear_attention"]},
     "hybrid"),
    ({"model_type": "llava", "text_config": {"model_type": "qwen3_next"}}, "hybrid"),
])
def test_kv_kind(config: dict, kind: str) -> None:
    assert kv_kind(config) == kind


def test_mla_and_hybrid_models_are_refused_on_kv_workers_only() -> None:
    mla = {"model_type": "deepseek_v2", "kv_lora_rank": 512, "num_attention_heads": 16}
    with pytest.raises(ValueError, match=r"latent attention.*serve it colocated"):
        check_model_shape(mla, 1, kv_transfer=True)
    with pytest.raises(ValueError, match="hybrid model"):
        check_model_shape({"model_type": "jamba"}, 1, kv_transfer=True)
    check_model_shape(mla, 2, kv_transfer=False)
