"""Shared-memory segments of the same-host KV transport.

The receiver owns every segment: it creates them under /dev/shm (mode 0600, names
`pdserve-kv-<pid>-<n>`), lends one per transfer, takes it back when the transfer's blocks
were copied out, and keeps released segments for reuse (a fresh segment costs page
faults: measured 3x slower than a reused one). A sender only maps a segment the receiver
named, so a crashed sender leaks nothing; a segment whose transfer failed is unlinked
rather than reused (its writer may still be writing). `close()` unlinks all segments, and
a starting receiver unlinks those left by receivers that died (their pid is gone).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)$")
_SEQ = itertools.count()  # per process: several receivers may share one


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def map_segment(name: str, nbytes: int) -> torch.Tensor:
    """Map the segment `name` (created by a receiver) as a flat uint8 tensor. The mapping
    lives as long as the tensor; raises OSError or ValueError if it cannot be mapped."""
    if not _NAME.match(name):
        raise ValueError(f"not a KV segment name: {name!r}")
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"segment {name} is smaller than {nbytes} bytes")
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


def sweep_stale() -> int:
    """Unlink segments of receivers that are no longer running; returns how many."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}*") if available() else ():
        m = _NAME.match(path.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed += 1
        except PermissionError:
            pass  # another user's live process
    return removed


class SegmentPool:
    """The receiver's segments; `get`/`put` mirror `SlabPool`, plus `name_of` and `retire`."""

    def __init__(self, max_pooled_bytes: int) -> None:
        self.max_pooled_bytes = max_pooled_bytes
        self._lock = threading.Lock()
        # data_ptr of a segment's tensor -> (its name, the tensor): holding the tensor
        # keeps the mapping, so no other segment can show up at the same address
        self._names: dict[int, tuple[str, torch.Tensor]] = {}
        self._free: list[torch.Tensor] = []
        removed = sweep_stale()
        if removed:
            logger.info("removed %d KV segments left by receivers that died", removed)

    def get(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, s in enumerate(self._free) if s.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        step = max(1 << 20, 1 << max(nbytes.bit_length() - 4, 0))
        size = -(-nbytes // step) * step
        name = f"{PREFIX}{os.getpid()}-{next(_SEQ)}"
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except OSError:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        seg = torch.frombuffer(mm, dtype=torch.uint8)
        seg.fill_(0)  # prefault once: reused segments never fault again
        with self._lock:
            self._names[seg.data_ptr()] = (name, seg)
        return seg

    def owns(self, seg: torch.Tensor) -> bool:
        with self._lock:
            return seg.data_ptr() in self._names

    def name_of(self, seg: torch.Tensor) -> str:
        with self._lock:
            return self._names[seg.data_ptr()][0]

    def describe(self, seg: torch.Tensor) -> dict[str, str]:
        """How a sender finds `seg`: the SEGMENT answer's fields."""
        return {"name": self.name_of(seg)}

    def put(self, seg: torch.Tensor) -> None:
        """Keep a segment whose transfer is over for reuse (or unlink beyond the cap)."""
        with self._lock:
            self._free.append(seg)
            self._free.sort(key=lambda s: s.numel())
            evicted = []
            while self._free and sum(s.numel() for s in self._free) > self.max_pooled_bytes:
                evicted.append(self._free.pop())
        for s in evicted:
            self.retire(s)

    def retire(self, seg: torch.Tensor) -> None:
        """Unlink a segment; its memory goes once every mapping of it is gone."""
        with self._lock:
            entry = self._names.pop(seg.data_ptr(), None)
        if entry is not None:
            (SHM_DIR / entry[0]).unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            names = [name for name, _ in self._names.values()]
            self._names, self._free = {}, []
        for name in names:
            (SHM_DIR / name).unlink(missing_ok=True)

    def names(self) -> set[str]:
        """The names of the segments this pool holds (lent or free)."""
        with self._lock:
            return {name for name, _ in self._names.values()}
