"""Prompt block hashes for prefix-cache-aware routing.

Chained like vLLM's own prefix cache: block i's hash covers blocks 0..i, so two prompts
share block i's hash only if they share everything up to it. Only full blocks count:
vLLM caches full blocks only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int = 64) -> list[str]:
    out: list[str] = []
    parent = b""
    full = min(len(token_ids) // block_size, max_blocks)
    if not full:  # a prompt shorter than a block: nothing to hash (and no numpy call)
        return out
    ids = np.asarray(token_ids[: full * block_size], dtype=np.int64)
    for i in range(full):
        h = hashlib.blake2b(parent + ids[i * block_size:(i + 1) * block_size].tobytes(),
                            digest_size=12)
        parent = h.digest()
        out.append(h.hexdigest())
    return out
