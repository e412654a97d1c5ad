"""The gRPC transport's malloc thresholds (services/kv/transport/heap.py)."""

from __future__ import annotations

import platform

import pytest

from services.kv.transport import heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_thresholds_are_set_once_and_stay_set() -> None:
    assert heap.keep_frames_on_heap()
    assert heap.keep_frames_on_heap()  # idempotent: every sender and receiver calls it


def test_frames_fit_under_the_mmap_threshold() -> None:
    from services.kv.transport.spec import TransportConfig

    # a frame is a whole gRPC message: at most max_message_bytes
    assert TransportConfig().max_message_bytes < heap.MMAP_THRESHOLD < heap.TRIM_THRESHOLD
