"""Layout fingerprints: what two engines must share before KV blocks may move between them.

A decode worker copies the prefill worker's KV blocks byte for byte into its paged cache,
so both sides must agree on everything that decides what those bytes mean: model, dtype,
block size, layer and head geometry (the model's, not a rank's: a transfer between
tensor-parallel workers carries a run of heads, `tp_layout.kv_pieces`), and how a
(block, head) page is packed (on CPU the
packing depends on the instruction set; on GPU on the attention backend). The receiver
refuses a transfer whose sender fingerprint differs and names the fields that differ.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from typing import Any

_FIELDS_INT = ("block_size", "num_layers", "num_kv_heads", "head_size")
_FIELDS_STR = ("model", "dtype", "kv_packing", "pdserve_version")


@dataclass(frozen=True, slots=True)
class LayoutFingerprint:
    """The KV layout of one engine; equal fingerprints mean blocks can be copied as bytes."""

    model: str  # served model name or path identity
    dtype: str  # KV cache dtype, e.g. "float32"
    block_size: int  # tokens per KV block
    num_layers: int
    # The model's KV heads, all ranks together: the same at any tensor-parallel size, so
    # workers of different sizes pair; each transfer names the heads it carries.
    num_kv_heads: int
    head_size: int
    kv_packing: str  # e.g. "cpu:avx2:k-transposed", or a GPU attention backend name
    pdserve_version: str  # wire and layout conventions of this release

    def __post_init__(self) -> None:
        for name in _FIELDS_INT:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in _FIELDS_STR:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayoutFingerprint:
        """Build from `to_dict()` output; raises ValueError on missing or mistyped fields."""
        if not isinstance(d, dict):
            raise ValueError(f"fingerprint must be an object, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"fingerprint lacks fields: {', '.join(missing)}")
        return cls(**{n: d[n] for n in names})

    def digest(self) -> str:
        """A short stable hash: the first 16 hex digits of sha256 over canonical JSON."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def differences(self, other: LayoutFingerprint) -> list[str]:
        """Fields that differ, as "name: mine != theirs", in declaration order."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                out.append(f"{f.name}: {mine!r} != {theirs!r}")
        return out


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """Who is at one end of a transfer."""

    worker_id: str
    epoch: int  # restart epoch: changes whenever the worker restarts, so stale peers show
    fingerprint: LayoutFingerprint

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError("worker_id must be a non-empty str")
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {self.epoch!r}")

    def to_dict(self) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "epoch": self.epoch,
            "fingerprint": self.fingerprint.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerIdentity:
        if not isinstance(d, dict):
            raise ValueError(f"identity must be an object, got {type(d).__name__}")
        try:
            return cls(d["worker_id"], d["epoch"], LayoutFingerprint.from_dict(d["fingerprint"]))
        except KeyError as e:
            raise ValueError(f"identity lacks field {e.args[0]}") from None
