"""The nixl transport's registered arena (on this process's real NIXL agent) and its
reading of a receiver's SEGMENT answer."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import torch

from services.kv.transport import cuda_ipc
from services.kv.transport.frames import FrameError
from services.kv.transport.nixl_agent import ALIGN, Arena, agent
from services.kv.transport.nixl_sender import _target


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def arena(clock: Clock, blocks: int = 4) -> Arena:
    return Arena(agent(), blocks * ALIGN, torch.device("cpu"), quarantine_s=5.0, clock=clock)


def test_regions_are_carved_aligned_and_coalesce_when_given_back() -> None:
    a = arena(Clock())
    try:
        assert a.mem == "DRAM" and a.free_bytes == a.nbytes == 4 * ALIGN
        one, two = a.get(1), a.get(ALIGN + 1)  # rounded up to whole ALIGN units
        assert (one.numel(), two.numel()) == (ALIGN, 2 * ALIGN)
        assert two.data_ptr() == one.data_ptr() + ALIGN and a.owns(two)
        assert a.describe(two) == {
            "addr": two.data_ptr(),
            "nbytes": 2 * ALIGN,
            "device": 0,
            "mem": "DRAM",
        }
        with pytest.raises(RuntimeError, match="arena full"):
            a.get(2 * ALIGN)
        a.put(one)
        a.put(two)
        assert a.free_bytes == a.nbytes
        whole = a.get(4 * ALIGN)  # the pieces merged back into one region
        assert whole.data_ptr() == a.base
    finally:
        a.close()


def test_a_retired_region_is_reused_only_after_the_quarantine() -> None:
    clock = Clock()
    a = arena(clock, blocks=2)
    try:
        failed = a.get(2 * ALIGN)
        a.retire(failed)  # a WRITE of its abandoned transfer may still land
        assert a.free_bytes == 0
        with pytest.raises(RuntimeError):
            a.get(1)
        clock.now += 5.0
        assert a.free_bytes == a.nbytes
        assert a.get(2 * ALIGN).data_ptr() == a.base
        a.put(torch.empty(3))  # not one of its regions: ignored
    finally:
        a.close()


def offer(**over: Any) -> dict[str, Any]:
    base = {
        "agent": "pdserve-1-abc",
        "metadata": base64.b64encode(b"md").decode(),
        "addr": 4096,
        "nbytes": 1024,
        "device": 0,
        "mem": "DRAM",
        "tag": "t0",
    }
    return {"nixl": {**base, **over}, "nbytes": 1024}


def test_a_well_formed_segment_is_read() -> None:
    t = _target(offer(), 1024)
    assert (t.agent, t.metadata, t.addr, t.mem, t.tag) == (
        "pdserve-1-abc",
        b"md",
        4096,
        "DRAM",
        "t0",
    )
    assert not t.device_digest
    assert _target(offer(checksum=cuda_ipc.DEVICE_CHECKSUM), 1024).device_digest


@pytest.mark.parametrize(
    ("body", "total", "detail"),
    [
        (offer(), 2048, "SEGMENT says 1024.*transfer of 2048"),
        (offer(nbytes=512), 1024, "a region of 512 bytes"),
        (offer(mem="FILE"), 1024, "unknown memory"),
        (offer(tag="a:b"), 1024, "transfer tag"),
        (offer(tag=""), 1024, "transfer tag"),
        (offer(metadata="not base64!"), 1024, "not base64"),
        (offer(addr="4096"), 1024, "'addr' must be int"),
        ({"nbytes": 1024}, 1024, "missing field 'nixl'"),
    ],
    ids=["short", "short-region", "memory", "tag-colon", "no-tag", "metadata", "addr", "absent"],
)
def test_a_malformed_segment_is_refused(body: dict[str, Any], total: int, detail: str) -> None:
    with pytest.raises(FrameError, match=detail):
        _target(body, total)
