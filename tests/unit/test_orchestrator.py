"""Pair checks and error mapping of the orchestrator: pure logic."""

from __future__ import annotations

import json

import pytest

from pdserve.v1 import worker_pb2 as wpb
from services.errors import IncompatiblePair, InvalidRequest, PermissionDenied
from services.kv.fingerprint import LayoutFingerprint
from services.kv.params import check_fault
from services.messages import PhaseBudget, split_budget
from services.router.orchestrator import check_pair


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
    with pytest.raises(IncompatiblePair, match=r"block_size: 128 != 16.*kv_packing"):
        check_pair(info("p"), info("d", block_size=16, kv_packing="cpu:avx512"))


def test_fault_injection_needs_permission() -> None:
    check_fault("", allowed=False)
    check_fault("noise_kv", allowed=True)
    with pytest.raises(PermissionDenied, match="fault injection is off"):
        check_fault("noise_kv", allowed=False)
    with pytest.raises(InvalidRequest, match="not one of"):
        check_fault("melt", allowed=True)


@pytest.mark.parametrize(("max_tokens", "min_tokens", "prefill", "decode"), [
    (10, 0, PhaseBudget(1, 0), PhaseBudget(9, 0)),
    (10, 4, PhaseBudget(1, 1), PhaseBudget(9, 3)),
    (10, 10, PhaseBudget(1, 1), PhaseBudget(9, 9)),
    (1, 0, PhaseBudget(1, 0), PhaseBudget(0, 0)),   # one token: no decode phase
    (1, 1, PhaseBudget(1, 1), PhaseBudget(0, 0)),
])
def test_budget_split(max_tokens: int, min_tokens: int, prefill: PhaseBudget,
                      decode: PhaseBudget) -> None:
    p, d = split_budget(max_tokens, min_tokens)
    assert (p, d) == (prefill, decode)
    # The phases together produce what the client asked for, and owe what it asked.
    assert p.max_tokens + d.max_tokens == max_tokens
    assert p.min_tokens + d.min_tokens == min_tokens
