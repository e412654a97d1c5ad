"""The CPU-checkable parts of the CUDA IPC path: the device digest (computed here on CPU
tensors, by the same code a GPU runs) and the validation of a lent slab's fields."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import torch

from services.kv.transport import cuda_ipc


def layer(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("nbytes", [0, 5, 8, 8 * cuda_ipc.ROW_WORDS + 3, 96 * 1024])
def test_digest_is_a_function_of_the_bytes(nbytes: int) -> None:
    a = layer(1, nbytes)
    value = cuda_ipc.device_digest(a)
    assert 0 <= value < 1 << 64
    assert cuda_ipc.device_digest(a.clone()) == value
    if nbytes % 4 == 0 and nbytes:  # any dtype view of the same bytes: the same digest
        assert cuda_ipc.device_digest(a.view(torch.float32)) == value


@pytest.mark.parametrize("where", [0, 7, 8 * cuda_ipc.ROW_WORDS, -1])
def test_digest_changes_with_any_flipped_bit(where: int) -> None:
    a = layer(2, 64 * 1024 + 3)
    value = cuda_ipc.device_digest(a)
    for bit in (0, 5, 7):
        b = a.clone()
        b[where] ^= 1 << bit
        assert cuda_ipc.device_digest(b) != value, (where, bit)


def test_digest_changes_when_rows_trade_places() -> None:
    rows = layer(3, 4 * 8 * cuda_ipc.ROW_WORDS).view(4, -1)
    swapped = rows[[1, 0, 2, 3]].contiguous()
    assert cuda_ipc.device_digest(swapped) != cuda_ipc.device_digest(rows)


def test_digest_of_an_unaligned_view_matches_its_copy() -> None:
    a = layer(4, 4096)
    view = a[3:3 + 1024]  # a layer of a slab need not start on an 8-byte boundary
    assert cuda_ipc.device_digest(view) == cuda_ipc.device_digest(view.clone())


def fields(**over: Any) -> dict[str, Any]:
    good: dict[str, Any] = {
        "handle": base64.b64encode(bytes(64)).decode(),
        "storage_nbytes": 1 << 20,
        "storage_offset": 0,
        "tensor_offset": 4096,
        "ref_handle": base64.b64encode(b"/torch_123_456_0").decode(),
        "ref_offset": 3,
        "event_handle": base64.b64encode(bytes(64)).decode(),
        "event_sync": True,
    }
    good.update(over)
    return good


def test_valid_fields_decode_to_bytes_and_ints() -> None:
    out = cuda_ipc.validated(fields(), 65536)
    assert out["handle"] == bytes(64) and out["ref_handle"] == b"/torch_123_456_0"
    assert out["tensor_offset"] == 4096 and out["event_sync"] is True
    assert cuda_ipc.validated(fields(event_handle=None), 8)["event_handle"] is None


@pytest.mark.parametrize(
    ("over", "nbytes", "message"),
    [
        ({"handle": None}, 8, "cuda_ipc.handle must be a non-empty base64 string"),
        ({"handle": "not base64!"}, 8, "cuda_ipc.handle is not valid base64"),
        ({"handle": "A" * 10000}, 8, "cuda_ipc.handle must be"),
        ({"ref_handle": 7}, 8, "cuda_ipc.ref_handle must be"),
        ({"event_handle": ""}, 8, "cuda_ipc.event_handle must be"),
        ({"storage_nbytes": "1"}, 8, "storage_nbytes must be a non-negative integer"),
        ({"ref_offset": -1}, 8, "ref_offset must be a non-negative integer"),
        ({"tensor_offset": True}, 8, "tensor_offset must be a non-negative integer"),
        ({"event_sync": 1}, 8, "event_sync must be a boolean"),
        ({}, (1 << 20) - 4095, "cannot hold"),
    ],
)
def test_bad_fields_are_refused_with_the_field_named(
    over: dict[str, Any], nbytes: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("!", "")):
        cuda_ipc.validated(fields(**over), nbytes)


def test_fields_must_be_an_object() -> None:
    with pytest.raises(ValueError, match="must be an object"):
        cuda_ipc.validated(["handle"], 8)


def test_mapping_key_names_the_slab_not_the_transfer() -> None:
    assert cuda_ipc.mapping_key(fields()) == cuda_ipc.mapping_key(fields(ref_offset=9))
    assert cuda_ipc.mapping_key(fields()) != cuda_ipc.mapping_key(fields(tensor_offset=0))


def test_device_slabs_lend_at_most_their_bound_and_take_slabs_back() -> None:
    # The bookkeeping is device-independent: CPU memory stands in for the GPU's here.
    slabs = cuda_ipc.DeviceSlabs(torch.device("cpu"), 4 << 20)
    a = slabs.get(3 << 20)
    with pytest.raises(RuntimeError, match="device staging full"):
        slabs.get(2 << 20)
    slabs.put(a)
    b = slabs.get(3 << 20)
    assert b.data_ptr() == a.data_ptr()  # reused
    slabs.retire(b)  # a failed transfer's slab: forgotten, not reused
    c = slabs.get(1 << 20)
    assert c.data_ptr() != a.data_ptr()
    slabs.put(c)
    d = slabs.get(4 << 20)  # the free 1 MiB slab is dropped to make room
    assert d.numel() >= 4 << 20
