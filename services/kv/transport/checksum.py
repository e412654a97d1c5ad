"""Payload checksums of the KV transports, from native libraries.

* "crc32c" (default): CRC-32C (Castagnoli) from the `crc32c` package, hardware
  accelerated (SSE4.2 / ARMv8 CRC instructions), releases the GIL on large buffers.
* "xxh3": the 64-bit XXH3 hash from `xxhash`; as fast, not a CRC (no burst-error
  guarantees, but a 64-bit value).
* "crc32": zlib's CRC-32, kept for comparison and old tooling; 6-7x slower.

The sender names its algorithm in each transfer's header; the receiver verifies with that
algorithm and refuses a transfer that names one it does not know. All functions take any
C-contiguous buffer (bytes, memoryview, numpy array) without copying it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import crc32c as _crc32c
import xxhash

DEFAULT = "crc32c"

Buffer = bytes | bytearray | memoryview


def _crc32c_digest(buf: Buffer) -> int:
    return int(_crc32c.crc32c(buf))


def _xxh3_digest(buf: Buffer) -> int:
    return int(xxhash.xxh3_64_intdigest(buf))


def _crc32_digest(buf: Buffer) -> int:
    return zlib.crc32(buf)


_DIGESTS: dict[str, Callable[[Buffer], int]] = {
    "crc32c": _crc32c_digest,
    "xxh3": _xxh3_digest,
    "crc32": _crc32_digest,
}
ALGORITHMS = tuple(_DIGESTS)


def known(name: object) -> bool:
    return isinstance(name, str) and name in _DIGESTS


def check(name: str) -> str:
    """`name` if it is a known algorithm; else ValueError naming the known ones."""
    if not known(name):
        raise ValueError(f"unknown checksum {name!r}; expected one of {', '.join(ALGORITHMS)}")
    return name


def digest(name: str, buf: Buffer) -> int:
    """The checksum of `buf` (an unsigned int of at most 64 bits)."""
    return _DIGESTS[name](buf)
