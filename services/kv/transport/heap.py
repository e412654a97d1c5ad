"""Keep the gRPC transport's frame buffers on the heap (glibc only).

Every gRPC frame reaches Python as a new `bytes` of up to `chunk_bytes` (1 MiB). glibc
serves an allocation that size with a fresh `mmap` until a free raises its threshold,
and gives the top of the heap back to the kernel whenever more than twice that is free:
each transfer then maps, faults in (zeroing every page) and unmaps its whole payload
again. Measured on the 46 MB benchmark transfer: about a quarter of the receiver's CPU,
and 1.2-1.5x the throughput once fixed thresholds keep the buffers in the heap.
Under tcmalloc, which pdserve preloads into CPU engines, this never happens and the call
changes nothing; it is for processes on glibc's malloc (GPU engines, tools, tests).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
# Above the largest gRPC message (8 MiB by default): frames come from the heap, while
# anything larger (big tensors) still gets a mapping of its own, returned when freed.
MMAP_THRESHOLD = 16 << 20
# Free heap kept rather than given back: a few transfers' worth of frames in flight.
TRIM_THRESHOLD = 128 << 20


@functools.cache  # once per process: every gRPC sender and receiver calls it
def keep_frames_on_heap() -> bool:
    """Set this process's malloc thresholds; False where this libc has no mallopt."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.debug("no mallopt in this libc: malloc thresholds left as they are")
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
