"""Prefix caches for the fleet simulation: which whole KV blocks of a prompt an engine
(or a router's index) holds.

A prompt is drawn as the chained keys of its whole blocks, as vLLM's prefix cache and the
router's prefix index hash them: block i's key covers blocks 0..i, so two prompts share
key i only if they share every token up to the end of block i, and a lookup finds a
leading run of blocks. A partial last block has no key (neither caches it).

An engine's cache is bounded by its KV cache and evicts the least recently used blocks
first, as vLLM's free block queue does. One simplification: blocks of running requests
are not pinned (vLLM never evicts them), which matters only when the KV cache is full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.router.prefix import block_digests


def block_keys(token_ids: Sequence[int], block_tokens: int) -> tuple[bytes, ...]:
    """The chained keys of the whole ``block_tokens``-token blocks of ``token_ids``: the
    router's own block hashes (services/router/prefix.py), every block of the prompt."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    return tuple(block_digests(token_ids, block_tokens,
                               max_blocks=len(token_ids) // block_tokens))


class PrefixCache:
    """The blocks one engine holds, or one worker's entries in a router's index;
    ``capacity`` blocks at most (0: unbounded, as the approximate index, which forgets
    nothing while a replay runs)."""

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError("a prefix cache's capacity cannot be negative")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def hits(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of ``keys`` held here, without touching them (what an index
        reports to the router)."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def match(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of ``keys`` held here; those found become the most recently
        used (an engine reusing them)."""
        n = self.hits(keys)
        for key in keys[:n]:
            self._blocks.move_to_end(key)
        return n

    def insert(self, keys: Sequence[bytes]) -> None:
        """Holds ``keys`` (most recently used last), evicting the least recently used
        blocks beyond the capacity."""
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        if self.capacity:
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
