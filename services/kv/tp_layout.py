"""KV heads over tensor-parallel ranks: which rank holds which heads, what moves where
when a prefill worker at TP=a feeds a decode worker at TP=b, and which models pdserve
can split and ship at all. Pure functions of a few numbers: no torch, no vLLM.

vLLM splits attention by heads (`QKVParallelLinear`): with TP=t and H KV heads, a rank
holds `max(1, H // t)` KV heads. When t <= H (t divides H) rank r holds the contiguous
heads `[r*H/t, (r+1)*H/t)`; when t > H (H divides t) the heads are replicated, t/H ranks
per head, and rank r holds head `r // (t/H)`. A rank's KV tensor holds its heads in that
order, so a head's position in the tensor is its index minus the rank's first head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def tp_problem(tp: int, num_heads: int, what: str = "KV heads") -> str:
    """Why `tp` ranks cannot split `num_heads` heads as vLLM does ("" when they can)."""
    if tp < 1:
        return f"tensor_parallel_size must be >= 1, got {tp}"
    if num_heads < 1:
        return f"the model must have at least one of its {what}, got {num_heads}"
    if tp <= num_heads and num_heads % tp:
        return (f"the model's {num_heads} {what} do not split over {tp} ranks: "
                f"tensor_parallel_size must divide {num_heads} (or be a multiple of it)")
    if tp > num_heads and tp % num_heads:
        return (f"the model's {num_heads} {what} do not replicate over {tp} ranks: "
                f"tensor_parallel_size must be a multiple of {num_heads} (or divide it)")
    return ""


def kv_heads_per_rank(tp: int, total_kv_heads: int) -> int:
    """KV heads in each rank's KV tensor (vLLM llama: `max(1, total // tp)`)."""
    problem = tp_problem(tp, total_kv_heads)
    if problem:
        raise ValueError(problem)
    return max(1, total_kv_heads // tp)


def rank_heads(rank: int, tp: int, total_kv_heads: int) -> range:
    """The (global) KV heads rank `rank` of `tp` holds, in the order of its KV tensor."""
    per = kv_heads_per_rank(tp, total_kv_heads)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not one of {tp} ranks")
    if tp <= total_kv_heads:
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // total_kv_heads)
    return range(head, head + 1)


def holders(head: int, tp: int, total_kv_heads: int) -> list[int]:
    """The ranks of `tp` that hold KV head `head` (several when heads are replicated)."""
    kv_heads_per_rank(tp, total_kv_heads)
    if tp <= total_kv_heads:
        return [head // (total_kv_heads // tp)]
    replicas = tp // total_kv_heads
    return list(range(head * replicas, (head + 1) * replicas))


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Heads `[start, stop)` of one rank's KV tensor (positions along its head axis)."""

    rank: int
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class KVPiece:
    """One transfer of a KV layout change: global heads `[head_start, head_stop)` go from
    `src` (a prefill rank's tensor positions) to `dst` (a decode rank's)."""

    head_start: int
    head_stop: int
    src: HeadSlice
    dst: HeadSlice


def kv_pieces(prefill_tp: int, decode_tp: int, total_kv_heads: int) -> list[KVPiece]:
    """Every transfer that gives each decode rank exactly its KV heads from the prefill
    ranks: one piece per run of consecutive heads that one prefill rank sends to one
    decode rank, ordered by decode rank, then head. Where the prefill side replicates a
    head, decode rank d takes it from replica `d % replicas`, so replicas share the
    sending. Raises ValueError for a TP size the heads cannot be split over."""
    for tp in (prefill_tp, decode_tp):
        problem = tp_problem(tp, total_kv_heads)
        if problem:
            raise ValueError(problem)
    pieces: list[KVPiece] = []
    for d in range(decode_tp):
        wanted = rank_heads(d, decode_tp, total_kv_heads)
        for head in wanted:
            sources = holders(head, prefill_tp, total_kv_heads)
            p = sources[d % len(sources)]
            src_pos = head - rank_heads(p, prefill_tp, total_kv_heads).start
            dst_pos = head - wanted.start
            last = pieces[-1] if pieces else None
            if (last is not None and last.dst.rank == d and last.src.rank == p
                    and last.head_stop == head and last.src.stop == src_pos
                    and last.dst.stop == dst_pos):
                pieces[-1] = KVPiece(last.head_start, head + 1,
                                     HeadSlice(p, last.src.start, src_pos + 1),
                                     HeadSlice(d, last.dst.start, dst_pos + 1))
            else:
                pieces.append(KVPiece(head, head + 1, HeadSlice(p, src_pos, src_pos + 1),
                                      HeadSlice(d, dst_pos, dst_pos + 1)))
    return pieces


def sends_of(prefill_rank: int, pieces: list[KVPiece]) -> list[KVPiece]:
    """The pieces one prefill rank sends."""
    return [p for p in pieces if p.src.rank == prefill_rank]


def receives_of(decode_rank: int, pieces: list[KVPiece]) -> list[KVPiece]:
    """The pieces one decode rank receives."""
    return [p for p in pieces if p.dst.rank == decode_rank]


# -- which models can be split and shipped ---------------------------------------------

# Model types whose KV is not per-head attention KV (multi-head latent attention keeps
# one compressed latent per token; state-space and linear-attention layers keep a
# recurrent state): pdserve's KV transfer, which moves per-head blocks, cannot ship it.
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2",
                             "minicpm3"})
HYBRID_MODEL_TYPES = frozenset({
    "jamba", "mamba", "mamba2", "falcon_h1", "falcon_mamba", "bamba", "zamba2",
    "nemotron_h", "granitemoehybrid", "qwen3_next", "plamo2", "minimax_text_01",
    "minimax_m1", "lfm2", "lfm2_moe", "kimi_linear", "hunyuan_a13b_hybrid"})
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})


def read_hf_config(model_path: Path) -> dict[str, Any]:
    """The model folder's config.json, as a dict ({} when it cannot be read)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def kv_kind(hf_config: dict[str, Any]) -> str:
    """"mla", "hybrid" or "attention" (per-head attention KV: what pdserve ships)."""
    text = hf_config.get("text_config")
    config = text if isinstance(text, dict) else hf_config
    model_type = str(config.get("model_type") or hf_config.get("model_type") or "")
    if model_type in MLA_MODEL_TYPES or config.get("kv_lora_rank"):
        return "mla"
    layer_types = config.get("layer_types") or config.get("layers_block_type") or []
    if (model_type in HYBRID_MODEL_TYPES or config.get("hybrid_override_pattern")
            or any(str(t) not in ATTENTION_LAYER_TYPES for t in layer_types)):
        return "hybrid"
    return "attention"


def check_model_shape(hf_config: dict[str, Any], tp: int, kv_transfer: bool) -> None:
    """Refuse, in words, a model pdserve cannot serve as asked: an MLA or hybrid model on
    a worker that ships KV, or a TP size its heads do not split over. An empty
    `hf_config` (unknown) passes: vLLM checks again."""
    if not hf_config:
        return
    kind = kv_kind(hf_config)
    if kind != "attention":
        if kv_transfer:
            what = ("multi-head latent attention (MLA)" if kind == "mla"
                    else "state-space or linear-attention layers (a hybrid model)")
            raise ValueError(
                f"this model uses {what}: pdserve's KV transfer moves per-head attention "
                "KV and cannot ship its cache, so it cannot run on prefill and decode "
                "workers; serve it colocated (`pdserve serve --mode colocated`)")
        return  # colocated: vLLM knows how to split it
    text = hf_config.get("text_config")
    config = text if isinstance(text, dict) else hf_config
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int):
        return
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % tp:
        raise ValueError(f"the model's {heads} attention heads do not split over {tp} "
                         f"ranks: tensor_parallel_size must divide {heads}")
    problem = tp_problem(tp, int(kv_heads))
    if problem:
        raise ValueError(problem)


class LayoutRefused(ValueError):
    """A layout pdserve will not serve, with what to do instead."""


def kv_workers_tp_problem(prefill_tp: int, decode_tp: int) -> str:
    """Why prefill and decode workers at these TP sizes cannot exchange KV ("" when
    they can). Any two sizes can, as far as the sizes go: each prefill rank ships its
    pieces (`kv_pieces`) to the decode ranks that hold those heads. Whether the model's
    heads split over each size is the model's question (`tp_problem`, checked where the
    model is known)."""
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        if tp < 1:
            return f"{role} TP {tp}: tensor_parallel_size must be >= 1"
    return ""


# -- one transfer per piece -------------------------------------------------------------

# Joins a transfer id and a piece's ranks. Not a character of request or transfer ids
# (`services.worker.checks.check_id`), so a piece's id never equals another transfer's.
PIECE_SEPARATOR = "#"


def piece_transfer_id(transfer_id: str, piece: KVPiece, pieces: list[KVPiece]) -> str:
    """The id of the transfer that carries `piece` of `transfer_id`: the id itself where
    the layout change is a single piece (both sides at TP=1), else the id with the
    piece's source and destination ranks (unique among the pieces: one run each)."""
    if len(pieces) == 1:
        return transfer_id
    return f"{transfer_id}{PIECE_SEPARATOR}{piece.src.rank}-{piece.dst.rank}"


def base_transfer_id(transfer_id: str) -> str:
    """The transfer a piece's transfer belongs to (an id without a piece: itself)."""
    return transfer_id.split(PIECE_SEPARATOR, 1)[0]
