"""The KV wire codec: data and control frames, specs, strict decoding."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch

from services.kv.fingerprint import LayoutFingerprint, PeerIdentity
from services.kv.transport import checksum, frames
from services.kv.transport.frames import ControlFrame, DataFrame, FrameError, FrameKind
from services.kv.transport.spec import TransferSpec

FP = LayoutFingerprint("m", "float32", 16, 4, 3, 128, "cpu:avx2:k-transposed", "0.1.0")
SENDER = PeerIdentity("prefill-0", 3, FP)


def make_spec(**over: object) -> TransferSpec:
    base: dict[str, object] = dict(
        transfer_id="req-1",
        num_layers=4,
        layer_shape=(2, 3, 16, 256),
        dtype=torch.float32,
        num_tokens=20,
        receiver_epoch=5,
        receiver_fingerprint=FP.digest(),
    )
    base.update(over)
    return TransferSpec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", checksum.ALGORITHMS)
def test_data_frame_round_trip_and_checksum(algorithm: str) -> None:
    payload = bytes(range(256)) * 10
    raw = frames.encode_data(3, 7, 4096, memoryview(payload), algorithm)
    assert len(raw) == frames.DATA_HEADER_BYTES + len(payload)
    f = frames.decode_frame(raw)
    assert isinstance(f, DataFrame)
    assert (f.layer, f.chunk, f.offset, f.nbytes) == (3, 7, 4096, len(payload))
    assert f.checksum == checksum.digest(algorithm, payload)
    assert bytes(f.payload) == payload
    corrupt = bytearray(raw)
    corrupt[-1] ^= 0x01
    g = frames.decode_frame(bytes(corrupt))
    assert isinstance(g, DataFrame) and checksum.digest(algorithm, g.payload) != g.checksum


def test_checksums_are_the_published_algorithms() -> None:
    # Known answers: CRC-32C("123456789") = 0xE3069283 (RFC 3720), CRC-32 = 0xCBF43926,
    # XXH3-64 of the empty input = 0x2D06800538D394C2 (xxHash's reference value).
    assert checksum.digest("crc32c", b"123456789") == 0xE3069283
    assert checksum.digest("crc32", b"123456789") == zlib.crc32(b"123456789") == 0xCBF43926
    assert checksum.digest("xxh3", b"") == 0x2D06800538D394C2
    big = memoryview(torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8).numpy())
    assert checksum.digest("crc32c", big) == checksum.digest("crc32c", bytes(big))
    with pytest.raises(ValueError, match="unknown checksum 'md5'"):
        checksum.check("md5")
    assert not checksum.known(None) and checksum.known("xxh3")


def test_header_round_trip_keeps_spec_and_identity() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        spec = make_spec(dtype=dtype)
        f = frames.decode_frame(frames.encode_header(SENDER, spec, "xxh3"))
        assert isinstance(f, ControlFrame) and f.kind is FrameKind.HEADER
        sender, got, algorithm = frames.decode_header(f.body)
        assert sender == SENDER and got == spec and algorithm == "xxh3"
        assert got.layer_nbytes == 2 * 3 * 16 * 256 * torch.empty((), dtype=dtype).element_size()


def test_ack_round_trip() -> None:
    assert frames.decode_ack(frames.encode_ack("t", True, None, 10)) == ("t", True, None, 10)
    assert frames.decode_ack(frames.encode_ack("t", False, "boom", 0)) == ("t", False, "boom", 0)
    with pytest.raises(FrameError):
        frames.decode_ack(frames.encode_control(FrameKind.END, {"chunks": 1}))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "shorter than 2"),
        (bytes((FrameKind.HEADER, 99)) + b"{}", "protocol version 99"),
        (bytes((42, frames.VERSION)), "unknown frame kind 42"),
        (bytes((FrameKind.DATA, frames.VERSION)) + b"abc", "shorter than its header"),
        (bytes((FrameKind.HEADER, frames.VERSION)) + b"{not json", "not valid JSON"),
        (bytes((FrameKind.HEADER, frames.VERSION)) + b"[1, 2]", "not an object"),
        (bytes((FrameKind.HEADER, frames.VERSION)) + b"\xff\xfe", "not valid JSON"),
        (bytes((FrameKind.END, frames.VERSION)) + b" " * frames.MAX_CONTROL_BYTES, "too large"),
    ],
)
def test_decode_rejects_malformed(raw: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        frames.decode_frame(raw)


def test_decode_rejects_payload_length_mismatch() -> None:
    raw = frames.encode_data(0, 0, 0, memoryview(b"abcd"), "crc32c")
    with pytest.raises(FrameError, match="says 4 payload bytes, carries 3"):
        frames.decode_frame(raw[:-1])
    lying = struct.pack("<BBxxIIQIxxxxQ", FrameKind.DATA, frames.VERSION, 0, 0, 0, 1 << 31, 0)
    with pytest.raises(FrameError):
        frames.decode_frame(lying + b"x")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("dtype", "complex128", "unsupported dtype"),
        ("dtype", "__class__", "unsupported dtype"),
        ("layer_shape", [2, "3"], "list of ints"),
        ("layer_shape", [2, 0], "positive dims"),
        ("num_layers", True, "must be int"),
        ("num_layers", 0, "num_layers must be positive"),
        ("transfer_id", "", "transfer_id"),
        ("receiver_epoch", "5", "must be int"),
    ],
)
def test_spec_from_dict_is_strict(key: str, value: object, message: str) -> None:
    d = frames.spec_to_dict(make_spec())
    d[key] = value
    with pytest.raises(FrameError, match=message):
        frames.spec_from_dict(d)


def test_header_with_bad_identity_is_a_frame_error() -> None:
    body = json.loads(frames.encode_header(SENDER, make_spec(), "crc32c")[2:])
    del body["sender"]["fingerprint"]["block_size"]
    with pytest.raises(FrameError, match="bad sender identity"):
        frames.decode_header(body)
    with pytest.raises(FrameError, match="missing field 'spec'"):
        frames.decode_header({"sender": SENDER.to_dict()})
    body = json.loads(frames.encode_header(SENDER, make_spec(), "crc32c")[2:])
    del body["checksum"]
    with pytest.raises(FrameError, match="missing field 'checksum'"):
        frames.decode_header(body)


def test_chunk_ranges_cover_exactly() -> None:
    assert list(frames.chunk_ranges(10, 4)) == [(0, 0, 4), (1, 4, 4), (2, 8, 2)]
    assert list(frames.chunk_ranges(8, 4)) == [(0, 0, 4), (1, 4, 4)]
    assert list(frames.chunk_ranges(0, 4)) == []


def test_byte_view_shares_memory() -> None:
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    view = frames.byte_view(t)
    assert len(view) == t.numel() * 2
    view[0:2] = torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert t[0, 0].item() == 1.5
    with pytest.raises(ValueError):
        frames.byte_view(torch.zeros(4, 4).t())


def test_slab_pool_reuses_slabs_of_several_sizes() -> None:
    import torch

    from services.kv.transport.slab_pool import SlabPool

    pool = SlabPool(torch.device("cpu"), max_bytes=1 << 30)
    small, large = pool.get(3 << 20), pool.get(40 << 20)
    pool.put(small)
    pool.put(large)
    again = pool.get(20 << 20)  # must pick the large one out of a mixed-size pool
    assert again.data_ptr() == large.data_ptr()
    assert pool.get(1 << 20).data_ptr() == small.data_ptr()
