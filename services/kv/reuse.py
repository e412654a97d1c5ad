"""Shipping only the KV blocks a decode worker lacks: the block arithmetic, pure.

The router may believe the decode worker already holds a prefix of the prompt in its own
prefix cache (`reuse_tokens`, whole blocks). The prefill worker then ships the prompt's
blocks from `first_block(...)` on; the transfer's spec and the decode request's
`RecvParams` both name that block, and the consumer refuses a transfer whose first block
is not the one the request expects.

On the decode engine, `plan_load` decides what the request claims from the transfer,
given the prefix its own cache holds when vLLM first looks at it (`num_computed`, whole
blocks). The blocks of that hit are in the request's block table from then on, with
their reference counts raised (vLLM's `allocate_slots` takes the hit's blocks while the
request waits in WAITING_FOR_REMOTE_KVS), so nothing evicts the reused prefix before the
shipped blocks land behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why a decode request computed its prompt itself although KV was shipped for it
# (`LoadReport.recomputed`, and the label of `pdserve_kv_reuse_fallbacks_total`).
REUSED_PREFIX_GONE = "reused_prefix_gone"  # it held fewer tokens than the skipped prefix


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def first_block(reuse_tokens: int, num_tokens: int, block_size: int) -> int:
    """The prompt block a transfer starts at, for a decode worker believed to hold the
    prompt's first `reuse_tokens` tokens: every whole block of them is left out, but the
    prompt's last block always travels (a transfer is never empty, and a decode worker
    holding the whole prompt claims nothing and drops it). ValueError for a hint that is
    not whole blocks of this prompt."""
    if block_size <= 0 or num_tokens <= 0:
        raise ValueError(f"block size {block_size} and prompt length {num_tokens} must be "
                         "positive")
    if reuse_tokens < 0 or reuse_tokens % block_size:
        raise ValueError(f"reuse_tokens: {reuse_tokens} is not a whole number of KV blocks "
                         f"of {block_size} tokens")
    if reuse_tokens > num_tokens:
        raise ValueError(f"reuse_tokens: {reuse_tokens} is more than the prompt's "
                         f"{num_tokens} tokens")
    return min(reuse_tokens // block_size, (num_tokens - 1) // block_size)


def shipped_blocks(num_tokens: int, block_size: int, first: int) -> range:
    """Indices of the prompt's blocks a transfer starting at `first` holds (the last,
    partial block travels whole: the decode side writes token 1 after it)."""
    return range(first, ceil_div(num_tokens, block_size))


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What a decode request takes from its transfer."""

    claim: int  # tokens to load from the transfer (0: nothing)
    first_block: int  # the first prompt block loaded (lands in the first block filled)
    recomputed: str = ""  # why the prompt is computed here instead ("" when loading)

    @property
    def drop_transfer(self) -> bool:
        """The transfer will never be loaded: the decode side should drop it now."""
        return self.claim == 0


def plan_load(num_computed: int, remote: int, transfer_first_block: int,
              block_size: int) -> LoadPlan:
    """The load of a request whose engine holds `num_computed` prompt tokens (whole
    blocks) and whose transfer holds its tokens up to `remote` from block
    `transfer_first_block` on.

    The engine's own prefix goes first: blocks it holds are never loaded. A gap between
    what it holds and the transfer's first block cannot be filled (the router believed in
    cached blocks that were evicted before the request came): nothing is claimed, and
    vLLM computes the prompt here, which is always right."""
    skipped = transfer_first_block * block_size
    if num_computed < skipped:
        return LoadPlan(0, 0, REUSED_PREFIX_GONE)
    if remote <= num_computed:
        return LoadPlan(0, 0)  # everything is here already
    return LoadPlan(remote - num_computed, num_computed // block_size)
