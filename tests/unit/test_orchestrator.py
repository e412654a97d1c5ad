"""Pair checks and error mapping of the orchestrator: pure logic."""

from __future__ import annotations

import json

import pytest

from pdserve.v1 import worker_pb2 as wpb
from services.api.validation import RequestError
from services.kv.fingerprint import LayoutFingerprint
from services.prefill.servicer import check_fault
from services.router.orchestrator import PairRefused, check_pair


def info(worker_id: str, **changes: object) -> wpb.WorkerInfo:
    fields: dict[str, object] = dict(model="m", dtype="float32", block_size=128, num_layers=30,
                                     num_kv_heads=3, head_size=64, kv_packing="cpu:avx2",
                                     pdserve_version="0.1.0")
    fp = LayoutFingerprint(**{**fields, **changes})  # type: ignore[arg-type]
    return wpb.WorkerInfo(worker_id=worker_id, fingerprint_digest=fp.digest(),
                          fingerprint_json=json.dumps(fp.to_dict()))


def test_same_layout_pairs() -> None:
    check_pair(info("p"), info("d"))


def test_different_layout_is_refused_naming_fields() -> None:
    with pytest.raises(PairRefused, match=r"block_size: 128 != 16.*kv_packing"):
        check_pair(info("p"), info("d", block_size=16, kv_packing="cpu:avx512"))


def test_fault_injection_needs_permission() -> None:
    check_fault("", allowed=False)
    check_fault("noise_kv", allowed=True)
    with pytest.raises(RequestError, match="fault injection is off"):
        check_fault("noise_kv", allowed=False)
    with pytest.raises(RequestError, match="not one of"):
        check_fault("melt", allowed=True)
