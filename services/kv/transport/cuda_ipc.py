"""CUDA IPC for the same-host transport: GPU to GPU without a host copy.

A decode worker whose engine runs on a GPU (`TransportConfig.ipc_device`) lends a slab of
its own device memory to a same-host sender that offered to write into one (the sender
also has `ipc_device` set): the SEGMENT answer carries the slab's CUDA IPC handle instead
of a /dev/shm segment name, the sender maps it on its own GPU (peer access over NVLink or
PCIe, enabled on demand) and copies each layer device to device. The payload never
touches host memory; the decode worker's copy into its paged cache is local.

The handle travels as plain fields (bytes base64-encoded), never as a pickle: the sender
validates them and rebuilds the tensor with torch's own IPC code
(`torch.multiprocessing.reductions.rebuild_cuda_tensor`), which also keeps the lender's
memory alive while the sender maps it. Each export takes a reference on the slab that
the sender's opening gives back (a reused slab is found in torch's mapping cache, and
the reference is released there), so the sender opens the fields of every transfer,
cached or not: a slab the receiver drops is freed once no transfer's reference is left.

Checksums: a CRC over device memory would need the bytes on the host, so a device slab
is checked with `device_digest`, a position-weighted 64-bit sum computed on the GPU on
both sides (the sender over its source layer, the receiver over the slab). It detects any
corrupt word and misplaced rows; it is not a CRC, and it does not need to be: the bytes
cross no wire, and what it guards against is a copy that did not land.

Tested on CPU: the digest, the handle's validation, the staging bound and the protocol
around them. The export, the mapping and the device-to-device copy need a GPU
(`tests/integration/test_kv_cuda_ipc.py`, skipped without one).
"""

from __future__ import annotations

import base64
import binascii
import threading
from typing import Any

import torch

from services.kv.transport.slab_pool import SlabPool

DEVICE_CHECKSUM = "sum64"  # named in SEGMENT: what LAYER frames carry for a device slab
ROW_WORDS = 1024  # 8-byte words per row of the digest's position weighting
_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # keeps equal sums from cancelling in the final xor
_MAX_HANDLE_BYTES = 4096  # a cudaIpcMemHandle is 64 bytes; allow for torch's wrappers


def device_digest(tensor: torch.Tensor) -> int:
    """A 64-bit digest of `tensor`'s bytes, computed where the tensor lives.

    The bytes are read as 64-bit words (wrapping integer sums: the same value on any
    device and in any reduction order); the plain sum catches a corrupt word, a second
    sum weighting each row of `ROW_WORDS` words by its index catches rows in the wrong
    place; MurmurHash3's finalizer folds the two into one value. Trailing bytes that do
    not fill a word count as one more word each."""
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.storage_offset() % 8:  # 64-bit views need aligned storage
        flat = flat.clone()
    whole = flat.numel() // 8 * 8
    words = flat[:whole].view(torch.int64)
    full = words.numel() // ROW_WORDS * ROW_WORDS
    rows = words[:full].view(-1, ROW_WORDS).sum(dim=1)
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=flat.device)
    parts = torch.stack([
        rows.sum() + words[full:].sum() + flat[whole:].to(torch.int64).sum(),
        (rows * weights).sum(),
    ])
    plain, weighted = (int(v) & _MASK for v in parts.tolist())  # one device sync
    return _fmix64(plain) ^ _fmix64(weighted ^ _MIX)


def _fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer: every input bit moves about half the output bits,
    so a change in one sum cannot cancel a change in the other."""
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & _MASK
    x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & _MASK
    return x ^ (x >> 33)


def export_slab(slab: torch.Tensor) -> dict[str, Any]:
    """The fields a same-host process needs to map `slab` (a flat uint8 CUDA tensor)."""
    (_device, handle, storage_nbytes, storage_offset, ref_handle, ref_offset,
     event_handle, event_sync) = slab.untyped_storage()._share_cuda_()
    return {
        "handle": _b64(handle),
        "storage_nbytes": int(storage_nbytes),
        "storage_offset": int(storage_offset),
        "tensor_offset": int(slab.storage_offset()),
        "ref_handle": _b64(ref_handle),
        "ref_offset": int(ref_offset),
        "event_handle": _b64(event_handle) if event_handle else None,
        "event_sync": bool(event_sync),
    }


def validated(fields: object, nbytes: int) -> dict[str, Any]:
    """`fields` from a SEGMENT answer, checked and decoded; ValueError says what is wrong."""
    if not isinstance(fields, dict):
        raise ValueError("cuda_ipc must be an object")
    out: dict[str, Any] = {}
    for key in ("handle", "ref_handle"):
        out[key] = _unb64(fields.get(key), key)
    event = fields.get("event_handle")
    out["event_handle"] = None if event is None else _unb64(event, "event_handle")
    for key in ("storage_nbytes", "storage_offset", "tensor_offset", "ref_offset"):
        value = fields.get(key)
        if type(value) is not int or value < 0:
            raise ValueError(f"cuda_ipc.{key} must be a non-negative integer")
        out[key] = value
    if type(fields.get("event_sync")) is not bool:
        raise ValueError("cuda_ipc.event_sync must be a boolean")
    out["event_sync"] = fields["event_sync"]
    if out["tensor_offset"] + nbytes > out["storage_nbytes"]:
        raise ValueError(
            f"cuda_ipc slab of {out['storage_nbytes']} bytes cannot hold {nbytes} bytes "
            f"at offset {out['tensor_offset']}"
        )
    return out


def open_slab(fields: object, nbytes: int, device: torch.device) -> torch.Tensor:
    """Map a lent slab on `device` (this process's GPU) as a flat uint8 tensor of `nbytes`.
    Raises ValueError for bad fields, RuntimeError where CUDA cannot map it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    f = validated(fields, nbytes)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([nbytes]), (1,), f["tensor_offset"], torch.UntypedStorage,
        torch.uint8, index, f["handle"], f["storage_nbytes"], f["storage_offset"], False,
        f["ref_handle"], f["ref_offset"], f["event_handle"], f["event_sync"],
    )


def mapping_key(fields: object) -> str:
    """Names a lent slab for the sender's mapping cache (the receiver reuses slabs)."""
    if not isinstance(fields, dict):
        return "cuda:?"  # never mapped: `validated` refuses it
    where = (fields.get(k) for k in ("handle", "storage_offset", "tensor_offset"))
    return "cuda:" + ":".join(map(str, where))


class DeviceSlabs:
    """The receiver's device staging lent over CUDA IPC: slabs of its GPU's memory that it
    can describe to a sender (`describe`: the SEGMENT answer's fields).

    This memory is outside vLLM's KV cache budget (leave room for it below
    `gpu_memory_utilization`), so it is bounded: at most `max_bytes`, lent and free
    together. A transfer that does not fit, or that the GPU has no memory for, is refused
    here (`get` raises RuntimeError) and the receiver lends it a host segment instead."""

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._pool = SlabPool(device, max_bytes)
        self._lock = threading.Lock()
        self._lent: dict[int, int] = {}  # data_ptr -> bytes of each slab lent out

    def get(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            lent = sum(self._lent.values())
            if lent + nbytes > self.max_bytes:
                raise RuntimeError(f"device staging full: {lent} bytes lent, {nbytes} more "
                                   f"would pass {self.max_bytes}")
            slab = self._pool.reuse(nbytes)
            if slab is None:
                if lent + self._pool.pooled_bytes + nbytes > self.max_bytes:
                    self._pool.clear()  # free slabs of other sizes make room for this one
                slab = self._pool.get(nbytes)  # torch.OutOfMemoryError is a RuntimeError
            self._lent[slab.data_ptr()] = slab.numel()
        return slab

    def put(self, slab: torch.Tensor) -> None:
        with self._lock:
            self._lent.pop(slab.data_ptr(), None)
            self._pool.put(slab)

    def retire(self, slab: torch.Tensor) -> None:
        """Not reused: freed once dropped; torch's IPC reference count keeps the memory
        until the sender lets go of its mapping."""
        with self._lock:
            self._lent.pop(slab.data_ptr(), None)

    def describe(self, slab: torch.Tensor) -> dict[str, Any]:
        return {"cuda_ipc": export_slab(slab), "checksum": DEVICE_CHECKSUM}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(value: object, key: str) -> bytes:
    if not isinstance(value, str) or not value or len(value) > _MAX_HANDLE_BYTES * 2:
        raise ValueError(f"cuda_ipc.{key} must be a non-empty base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"cuda_ipc.{key} is not valid base64") from None
