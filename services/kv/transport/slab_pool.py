"""Reused staging memory for the KV receiver."""

from __future__ import annotations

import threading

import torch


class SlabPool:
    """Reused flat byte slabs for staging. Fresh memory is paged in while the payload is
    written into it, which slowed receiving 2-3x in measurements; reused slabs are not."""

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        self.device, self.max_bytes = device, max_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def reuse(self, nbytes: int) -> torch.Tensor | None:
        """The smallest free slab of at least `nbytes`, or None."""
        with self._lock:
            # By position, never `list.remove`: that compares tensors with `==`, which
            # broadcasts (and fails) across slabs of different sizes.
            fits = [i for i, s in enumerate(self._free) if s.numel() >= nbytes]
            if not fits:
                return None
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))

    def get(self, nbytes: int) -> torch.Tensor:
        slab = self.reuse(nbytes)
        if slab is not None:
            return slab
        # Round up so that transfers of similar length can share slabs later.
        step = max(1 << 20, 1 << max(nbytes.bit_length() - 4, 0))
        return torch.empty(-(-nbytes // step) * step, dtype=torch.uint8, device=self.device)

    def put(self, slab: torch.Tensor) -> None:
        with self._lock:
            self._free.append(slab)
            self._free.sort(key=lambda s: s.numel())
            while self._free and sum(s.numel() for s in self._free) > self.max_bytes:
                self._free.pop()  # evict the largest

    def retire(self, slab: torch.Tensor) -> None:
        """A slab that must not be reused (its writer may still be writing): the garbage
        collector frees it once the writer lets go."""

    def clear(self) -> None:
        """Drop every free slab (its memory goes back to the allocator)."""
        with self._lock:
            self._free = []

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return sum(s.numel() for s in self._free)
