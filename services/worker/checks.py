"""Validation of the internal worker API. A worker trusts no caller: every field of a
`PrefillRequest` / `DecodeRequest` is checked here before any of it reaches the engine
or the KV connector (a bad transport name there would take the engine down)."""

from __future__ import annotations

import re

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services import limits as model_limits
from services.errors import IncompatiblePair, InvalidRequest
from services.messages import Sampling

KV_TRANSPORTS = ("grpc", "torch", "nixl")  # network transports; shm is chosen by `same_host`
MAX_ID_CHARS = 128
_ID = re.compile(r"^[A-Za-z0-9._:-]+$")
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


def check_id(name: str, value: str) -> str:
    if not value:
        raise InvalidRequest(f"{name}: required")
    if len(value) > MAX_ID_CHARS or not _ID.match(value):
        raise InvalidRequest(f"{name}: {value[:40]!r} must be 1..{MAX_ID_CHARS} characters "
                             "of letters, digits and . _ : -")
    return value


def check_address(name: str, value: str) -> str:
    m = _ADDRESS.match(value)
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise InvalidRequest(f"{name}: {value[:80]!r} is not host:port")
    return value


def check_prompt(ids: list[int], limits: model_limits.Limits, name: str) -> list[int]:
    model_limits.check_token_ids(ids, limits, name)
    if len(ids) >= limits.max_model_len:
        raise InvalidRequest(f"{name}: {len(ids)} tokens do not fit the context of "
                             f"{limits.max_model_len}")
    return ids


def check_sampling(s: pb.SamplingParams, limits: model_limits.Limits,
                   prompt_len: int) -> tuple[Sampling, int]:
    """The validated sampling and the max_tokens it resolves to for this prompt."""
    sampling = model_limits.check_sampling(s, limits)
    return sampling, model_limits.resolve_max_tokens(sampling, prompt_len, limits)


def check_target(t: wpb.KVTarget, own_digest: str, own_layout: str) -> None:
    check_id("target.worker_id", t.worker_id)
    check_address("target.kv_address", t.kv_address)
    for i, address in enumerate(t.kv_addresses):
        check_address(f"target.kv_addresses[{i}]", address)
    if t.kv_addresses and t.kv_addresses[0] != t.kv_address:
        raise InvalidRequest(f"target.kv_addresses[0]: {t.kv_addresses[0][:80]!r} is not "
                             f"target.kv_address {t.kv_address[:80]!r} (the first rank's)")
    if t.kv_transport not in KV_TRANSPORTS:
        raise InvalidRequest(f"target.kv_transport: {t.kv_transport!r} is not one of "
                             f"{KV_TRANSPORTS}")
    if t.fingerprint_digest != own_digest:
        raise IncompatiblePair(
            f"target: decode worker {t.worker_id} has KV layout {t.fingerprint_digest}, "
            f"this prefill worker {own_digest} ({own_layout}); pair workers that serve the "
            "same model with the same dtype, block size and attention layout")
