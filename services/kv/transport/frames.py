"""Wire frames of the KV transfer protocol, and the byte views the codec works on.

Every frame is one gRPC message (raw bytes, no protobuf on the hot path: protobuf would
copy each payload again). Byte 0 is the `FrameKind`, byte 1 the protocol version.

* DATA frames carry payload: a fixed little-endian header (layer index, chunk index,
  byte offset inside the layer, payload size, 64-bit checksum of the payload) then the
  payload. The checksum algorithm is named once, in the transfer's HEADER.
* All other frames are rare control frames: the two bytes, then a JSON object.

gRPC transfers use HEADER, DATA..., END on one client stream, answered by one ACK. The
torch.distributed transport sends HELLO/READY to set up a pair group, then HEADER,
LAYER (per-layer size and checksum; the payload goes over the pair group), END and CANCEL
on one bidirectional control stream per pair, answered by ACKs. Both are methods of the
generic-handler service `pdserve.v1.KVTransfer` (Push: client stream of frames -> ACK;
Pair: bidirectional stream; Shm: bidirectional stream of HEADER, LAYER..., END answered
by SEGMENT then ACK), served without protobuf so payloads are never re-copied.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.transport import checksum
from services.kv.transport.spec import TransferSpec

VERSION = 2  # 2: 64-bit checksums, algorithm named in the HEADER
MAX_CONTROL_BYTES = 64 << 10  # a header is ~1 KB; anything far larger is not ours

# kind u8, version u8, 2 pad, layer u32, chunk u32, offset u64, nbytes u32, 4 pad, checksum u64
_DATA = struct.Struct("<BBxxIIQIxxxxQ")
DATA_HEADER_BYTES = _DATA.size

# Names accepted on the wire; a closed list, so a peer cannot name arbitrary attributes.
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


class FrameKind(enum.IntEnum):
    """Frame kinds; the JSON fields of control frames are listed with each."""

    HEADER = 1  # {sender: PeerIdentity, spec: TransferSpec, checksum: algorithm name}
    DATA = 2  # binary, see _DATA (gRPC transport only)
    END = 3  # {chunks, nbytes} (+ transfer_id on a pair stream): totals sent
    ACK = 4  # {transfer_id, ok, error, nbytes}: the receiver's verdict
    HELLO = 5  # {sender, pair_id, receiver_host, device}: asks for a pair group
    READY = 6  # {store_port, prefix}: where to rendezvous for it
    LAYER = 7  # {transfer_id, layer, nbytes, checksum, tag}: a payload follows on the group
    #            (shm: {layers: [[layer, nbytes, checksum], ...]}, layers in the segment)
    CANCEL = 8  # {transfer_id, reason}: the sender abandons a transfer
    SEGMENT = 9  # {name, nbytes, batches}: the shared-memory segment to write a transfer into


class FrameError(ValueError):
    """A frame that cannot be decoded; the stream it came on is not trusted further."""


@dataclass(frozen=True, slots=True)
class DataFrame:
    layer: int
    chunk: int
    offset: int
    nbytes: int
    checksum: int  # of the payload, by the algorithm the transfer's header names
    payload: memoryview  # a view into the received message: no copy


@dataclass(frozen=True, slots=True)
class ControlFrame:
    kind: FrameKind
    body: dict[str, Any]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise FrameError(f"unsupported dtype {name!r}") from None


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat, writable byte view of a contiguous CPU tensor (shares its memory)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def chunk_ranges(total: int, chunk_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(chunk index, offset, size) covering `total` bytes in bounded chunks."""
    for idx, offset in enumerate(range(0, total, chunk_bytes)):
        yield idx, offset, min(chunk_bytes, total - offset)


def encode_data(layer: int, chunk: int, offset: int, payload: memoryview, algorithm: str) -> bytes:
    """One DATA frame; the join is the only copy of the payload on the sending side."""
    value = checksum.digest(algorithm, payload)
    head = _DATA.pack(FrameKind.DATA, VERSION, layer, chunk, offset, len(payload), value)
    return b"".join((head, payload))


def encode_control(kind: FrameKind, body: dict[str, Any]) -> bytes:
    return bytes((kind, VERSION)) + json.dumps(body, separators=(",", ":")).encode()


def decode_frame(frame: bytes) -> DataFrame | ControlFrame:
    """Parse one frame; raises FrameError on anything malformed."""
    if not isinstance(frame, bytes | bytearray) or len(frame) < 2:
        raise FrameError("frame shorter than 2 bytes")
    kind_byte, version = frame[0], frame[1]
    if version != VERSION:
        raise FrameError(f"protocol version {version} (this side speaks {VERSION})")
    try:
        kind = FrameKind(kind_byte)
    except ValueError:
        raise FrameError(f"unknown frame kind {kind_byte}") from None
    if kind is FrameKind.DATA:
        if len(frame) < DATA_HEADER_BYTES:
            raise FrameError(f"data frame of {len(frame)} bytes is shorter than its header")
        _, _, layer, chunk, offset, nbytes, value = _DATA.unpack_from(frame)
        payload = memoryview(frame)[DATA_HEADER_BYTES:]
        if len(payload) != nbytes:
            raise FrameError(f"data frame says {nbytes} payload bytes, carries {len(payload)}")
        return DataFrame(layer, chunk, offset, nbytes, value, payload)
    if len(frame) > MAX_CONTROL_BYTES:
        raise FrameError(f"{kind.name} frame of {len(frame)} bytes is too large")
    try:
        body = json.loads(bytes(frame[2:]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError(f"{kind.name} frame is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise FrameError(f"{kind.name} frame body is not an object")
    return ControlFrame(kind, body)


_T = TypeVar("_T")


def field(body: dict[str, Any], key: str, typ: type[_T]) -> _T:
    """body[key], checked to be of `typ` (bool is not an int here)."""
    if key not in body:
        raise FrameError(f"missing field {key!r}")
    value = body[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise FrameError(f"field {key!r} must be {typ.__name__}, got {type(value).__name__}")
    return value


def spec_to_dict(spec: TransferSpec) -> dict[str, Any]:
    return {
        "transfer_id": spec.transfer_id,
        "num_layers": spec.num_layers,
        "layer_shape": list(spec.layer_shape),
        "dtype": dtype_name(spec.dtype),
        "num_tokens": spec.num_tokens,
        "receiver_epoch": spec.receiver_epoch,
        "receiver_fingerprint": spec.receiver_fingerprint,
        "lora": spec.lora,
        "first_block": spec.first_block,
        "head_start": spec.head_start,
        "head_stop": spec.head_stop,
    }


def spec_from_dict(d: dict[str, Any]) -> TransferSpec:
    shape = field(d, "layer_shape", list)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
        raise FrameError("layer_shape must be a list of ints")
    try:
        return TransferSpec(
            transfer_id=field(d, "transfer_id", str),
            num_layers=field(d, "num_layers", int),
            layer_shape=tuple(shape),
            dtype=dtype_from_name(field(d, "dtype", str)),
            num_tokens=field(d, "num_tokens", int),
            receiver_epoch=field(d, "receiver_epoch", int),
            receiver_fingerprint=field(d, "receiver_fingerprint", str),
            lora=field(d, "lora", str) if "lora" in d else "",
            first_block=field(d, "first_block", int) if "first_block" in d else 0,
            head_start=field(d, "head_start", int) if "head_start" in d else 0,
            head_stop=field(d, "head_stop", int) if "head_stop" in d else 0,
        )
    except ValueError as e:
        raise FrameError(f"bad transfer spec: {e}") from None


def encode_header(
    sender: PeerIdentity, spec: TransferSpec, algorithm: str, **offers: Any
) -> bytes:
    """A transfer's HEADER; `offers` are transport-specific keys a receiver may ignore
    (the shm sender's `cuda_ipc`)."""
    body = {"sender": sender.to_dict(), "spec": spec_to_dict(spec), "checksum": algorithm,
            **offers}
    return encode_control(FrameKind.HEADER, body)


def decode_header(body: dict[str, Any]) -> tuple[PeerIdentity, TransferSpec, str]:
    """(sender, spec, checksum algorithm) of a HEADER; the algorithm is checked by whoever
    accepts the transfer, so that an unknown one is a refusal with a reason."""
    try:
        sender = PeerIdentity.from_dict(field(body, "sender", dict))
    except ValueError as e:
        raise FrameError(f"bad sender identity: {e}") from None
    spec = spec_from_dict(field(body, "spec", dict))
    return sender, spec, field(body, "checksum", str)[:64]


def encode_ack(transfer_id: str, ok: bool, error: str | None, nbytes: int) -> bytes:
    return encode_control(
        FrameKind.ACK, {"transfer_id": transfer_id, "ok": ok, "error": error, "nbytes": nbytes}
    )


def decode_ack(frame: bytes) -> tuple[str, bool, str | None, int]:
    """(transfer_id, ok, error, nbytes) of an ACK frame."""
    parsed = decode_frame(frame)
    if not isinstance(parsed, ControlFrame) or parsed.kind is not FrameKind.ACK:
        raise FrameError("expected an ACK frame")
    error = parsed.body.get("error")
    ok = field(parsed.body, "ok", bool)
    return (
        field(parsed.body, "transfer_id", str),
        ok,
        None if ok else str(error),
        field(parsed.body, "nbytes", int),
    )
