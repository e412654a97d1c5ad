"""HMAC-SHA256 over what pdserve keeps in Redis, under a cluster secret.

Redis is shared state that anyone with its password can write. A worker record says
where users' prompts go and a desired-state document can stop the stack, so both carry
an HMAC under a secret that only pdserve's own processes hold: a writer without it can
neither become a worker nor steer the launcher. A record that fails is skipped by the
reader (logged and counted), never trusted and never fatal.

The MAC covers the record's JSON with sorted keys and compact separators, minus the
`sig` field, prefixed by the kind of document ("worker", "desired"), so a valid record
of one kind is never accepted as the other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from services.registry.records import BadRecord, json_object

log = logging.getLogger(__name__)

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
SIG_FIELD = "sig"
MIN_SECRET_BYTES = 16


def canonical(kind: str, body: dict[str, Any]) -> bytes:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return f"pdserve-{kind}-v1\n{text}".encode()


class RecordSigner:
    """Seals and opens signed documents. Without a secret it writes unsigned documents
    and accepts any (the explicit opt-out: `--allow-unsigned-records`)."""

    def __init__(self, secret: bytes | None) -> None:
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        self._key = secret

    @property
    def signs(self) -> bool:
        return self._key is not None

    def _mac(self, kind: str, body: dict[str, Any]) -> str:
        assert self._key is not None
        return hmac.new(self._key, canonical(kind, body), hashlib.sha256).hexdigest()

    def seal(self, kind: str, body: dict[str, Any]) -> str:
        """`body` as JSON, with its MAC in `sig` when this signer has a secret."""
        body = {k: v for k, v in body.items() if k != SIG_FIELD}
        if self._key is not None:
            body[SIG_FIELD] = self._mac(kind, body)
        return json.dumps(body, allow_nan=False)

    def open(self, kind: str, text: str | bytes) -> dict[str, Any]:
        """The document's fields (without `sig`); `BadRecord` if it is not JSON or,
        with a secret, its MAC is missing or wrong."""
        body = json_object(text)
        sig = body.pop(SIG_FIELD, None)
        if self._key is None:
            return body
        if not isinstance(sig, str):
            raise BadRecord("signature", "unsigned")
        try:
            expected = self._mac(kind, body)
        except ValueError:  # NaN or infinity: never produced by seal
            raise BadRecord("signature", "not canonical JSON") from None
        if not hmac.compare_digest(sig, expected):
            raise BadRecord("signature", "the HMAC does not match the cluster secret")
        return body


def new_secret() -> str:
    """A fresh cluster secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def read_secret_file(path: str) -> bytes:
    data = Path(path).read_bytes().strip()
    if not data:
        raise ValueError(f"the cluster secret file {path} is empty")
    return data


def load_secret(secret: str = "", secret_file: str = "") -> bytes | None:
    """The cluster secret from a setting's value or file (the value wins); None if
    neither is set."""
    if secret:
        return secret.encode()
    if secret_file:
        return read_secret_file(secret_file)
    return None


def record_signer(secret: str = "", secret_file: str = "", allow_unsigned: bool = False,
                  who: str = "pdserve") -> RecordSigner:
    """The signer a router, worker or launcher uses, from its settings. Without a secret
    this refuses unless `allow_unsigned` (then it warns once at start)."""
    key = load_secret(secret, secret_file)
    if key is None:
        if not allow_unsigned:
            raise ValueError(
                f"{who}: no cluster secret: set {SECRET_ENV} or --cluster-secret-file (the "
                "HMAC key of worker records in Redis), or pass --allow-unsigned-records to "
                "trust any writer to Redis")
        log.warning("%s: cluster records are NOT signed (--allow-unsigned-records): anyone "
                    "who can write to Redis can register a worker", who)
    return RecordSigner(key)


_warned_env = False


def signer_from_env() -> RecordSigner:
    """The signer of a process whose settings were not threaded through: the secret from
    PDSERVE_CLUSTER_SECRET or PDSERVE_CLUSTER_SECRET_FILE; unsigned (with a warning,
    once) when neither is set."""
    global _warned_env
    key = load_secret(os.environ.get(SECRET_ENV, ""), os.environ.get(SECRET_FILE_ENV, ""))
    if key is None and not _warned_env:
        _warned_env = True
        log.warning("no cluster secret (%s): Redis records are read and written unsigned",
                    SECRET_ENV)
    return RecordSigner(key)
