"""Prompt block hashes for prefix-cache-aware routing, and the writer that records which
prefill worker holds them.

Chained like vLLM's own prefix cache: block i's hash covers blocks 0..i, so two prompts
share block i's hash only if they share everything up to it. Only full blocks count:
vLLM caches full blocks only.

The prefix index is a routing hint: a request never waits for it to be written, and a
write that fails or cannot be started only costs a later request its best pair.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import Counter

if TYPE_CHECKING:
    from services.router.view import WorkerView

log = logging.getLogger(__name__)

HINTS_DROPPED = Counter("pdserve_router_prefix_hints_dropped",
                        "prefix index writes given up, by why", ["reason"])
MAX_PENDING_WRITES = 64  # writes in flight at once; more are dropped (a slow Redis)
LOG_EVERY_S = 30.0  # a failing index is reported this often, not once per request


def chain_root(salt: str = "") -> bytes:
    """The parent of a prompt's first block: empty for the base model, else keyed by the
    LoRA adapter's name (KV computed under an adapter is cached apart from the base
    model's, as in vLLM's prefix cache)."""
    return hashlib.blake2b(b"lora:" + salt.encode(), digest_size=12).digest() if salt else b""


def chain_hash(parent: bytes, block_tokens: Sequence[int] | np.ndarray) -> bytes:
    """Block hash of `block_tokens` after the block whose hash is `parent`."""
    ids = np.asarray(block_tokens, dtype=np.int64)
    return hashlib.blake2b(parent + ids.tobytes(), digest_size=12).digest()


def block_digests(token_ids: Sequence[int], block_size: int, max_blocks: int = 64,
                  salt: str = "") -> list[bytes]:
    """The chained hashes of the prompt's first full blocks (at most `max_blocks`)."""
    out: list[bytes] = []
    full = min(len(token_ids) // block_size, max_blocks)
    if not full:  # a prompt shorter than a block: nothing to hash (and no numpy call)
        return out
    parent = chain_root(salt)
    ids = np.asarray(token_ids[: full * block_size], dtype=np.int64)
    for i in range(full):
        parent = chain_hash(parent, ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int = 64,
                 salt: str = "") -> list[str]:
    """`block_digests` as hex, the keys of the registry's approximate index; `salt` (a
    LoRA adapter's name) keys the chain."""
    return [h.hex() for h in block_digests(token_ids, block_size, max_blocks, salt)]


class PrefixHints:
    """Records, in the background, that a prefill worker prefilled a prompt's blocks.
    At most `max_pending` writes run at once: beyond that a hint is dropped and counted
    (`pdserve_router_prefix_hints_dropped{reason="backlog"}`), as is a write that fails
    (`reason="error"`, logged). `close` cancels the writes still running."""

    def __init__(self, view: WorkerView, max_pending: int = MAX_PENDING_WRITES) -> None:
        self._view = view
        self._max_pending = max_pending
        self._pending: set[asyncio.Task[None]] = set()  # held: the loop keeps weak refs
        self._reported = -LOG_EVERY_S  # time.monotonic() of the last report
        self._unreported = 0  # hints dropped since then

    @property
    def pending(self) -> int:
        return len(self._pending)

    def record(self, worker_id: str, hashes: Sequence[str]) -> None:
        """Start writing the hint; returns at once."""
        if len(self._pending) >= self._max_pending:
            self._dropped("backlog", f"{len(self._pending)} writes still pending")
            return
        task = asyncio.get_running_loop().create_task(self._write(worker_id, hashes))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, worker_id: str, hashes: Sequence[str]) -> None:
        try:
            await self._view.record_prefix(worker_id, hashes)
        except Exception as e:  # the hint is lost, the request is not
            self._dropped("error", f"{type(e).__name__}: {e}")

    def _dropped(self, reason: str, detail: str) -> None:
        HINTS_DROPPED.labels(reason).inc()
        self._unreported += 1
        now = time.monotonic()
        if now - self._reported >= LOG_EVERY_S:
            log.warning("prefix index hint dropped (%s: %s); %d dropped since the last "
                        "report", reason, detail, self._unreported)
            self._reported, self._unreported = now, 0

    async def close(self) -> None:
        """Cancel the writes still running and wait for them to end."""
        tasks = list(self._pending)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
