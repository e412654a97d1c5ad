"""API keys of the public API.

Each key names a client: the name is what per-client limits count and what logs show, so
a client cannot claim another's name. Keys come from a file, from the environment
variable `PDSERVE_API_KEYS`, or both:

- the file: one `client-name:key` per line; blank lines and lines starting with `#` are
  skipped. A key may be given as its SHA-256 instead (`client-name:sha256:<64 hex>`), so
  the file need not hold the key itself (`python -m services.security.apikeys new NAME`
  prints both forms of a fresh key).
- `PDSERVE_API_KEYS`: the same entries, separated by commas.

A client may have several keys (rotation: add the new key, move the client over, remove
the old one). The file is re-read when it changes (checked at most every
`RELOAD_S` seconds), so keys rotate without a restart; a file that no longer parses
leaves the previous keys in force and logs why.

Only SHA-256 digests are kept in memory; a presented key is hashed and compared with
every digest in constant time (`hmac.compare_digest`, no early exit), so neither the
answer's timing nor a memory dump gives a key away.
"""

from __future__ import annotations

import argparse
import contextvars
import hashlib
import hmac
import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.errors import Unauthenticated

log = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_API_KEYS"
HASHED_PREFIX = "sha256:"
MIN_KEY_CHARS = 16  # shorter keys are guessable; `new_key` makes 43-character ones
RELOAD_S = 2.0
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")

MISSING_KEY = ("missing API key: send the header `authorization: Bearer <key>` "
               "(pdserve generate --api-key, or the openai client's api_key)")
INVALID_KEY = "invalid API key"  # never echoes the key


# The client the current call's API key names: set by the gRPC interceptor and the HTTP
# middleware inside each authenticated call's own task, read by `authenticated_client`.
CURRENT_CLIENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pdserve_authenticated_client", default=None)


def authenticated_client() -> str | None:
    """The client named by the current call's API key (None on a server without keys).
    Per-client limits use this instead of the caller's own `x-client-id` whenever it is
    set, so a client cannot spend another's quota."""
    return CURRENT_CLIENT.get()


def client_id(claimed: str) -> str:
    """The client a request counts against: the one its API key names on a server with
    keys; otherwise what the caller claims (`x-client-id`), which is all there is."""
    return CURRENT_CLIENT.get() or claimed


class ApiKeyError(ValueError):
    """An API-key source that does not parse; the message names the source and line."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    client: str
    digest: bytes  # SHA-256 of the key


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_entry(entry: str, where: str) -> ApiKey:
    """One `client-name:key` or `client-name:sha256:<hex>` entry."""
    client, sep, secret = entry.strip().partition(":")
    if not sep or not client:
        raise ApiKeyError(f"{where}: expected `client-name:key`, got no `:`")
    if not _NAME.fullmatch(client):
        raise ApiKeyError(f"{where}: client name {client!r} must be 1-64 letters, digits "
                          f"or _.@- (starting with a letter or digit)")
    if secret.startswith(HASHED_PREFIX):
        hexdigest = secret.removeprefix(HASHED_PREFIX).lower()
        if not _HEX_DIGEST.fullmatch(hexdigest):
            raise ApiKeyError(f"{where}: {HASHED_PREFIX} must be followed by 64 hex digits")
        return ApiKey(client, bytes.fromhex(hexdigest))
    if len(secret) < MIN_KEY_CHARS or secret != secret.strip():
        raise ApiKeyError(f"{where}: the key of {client!r} must be at least {MIN_KEY_CHARS} "
                          f"characters without surrounding spaces (make one with "
                          f"`python -m services.security.apikeys new {client}`)")
    return ApiKey(client, digest(secret))


def parse_file_text(text: str, source: str) -> list[ApiKey]:
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            keys.append(parse_entry(line, f"{source}:{number}"))
    return keys


def parse_env_value(value: str) -> list[ApiKey]:
    return [parse_entry(entry, f"{ENV_VAR} entry {i}")
            for i, entry in enumerate(value.split(","), 1) if entry.strip()]


def read_key_file(path: Path) -> list[ApiKey]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ApiKeyError(f"API key file {path}: cannot be read ({e.strerror}); point "
                          f"--api-keys-file at a readable file of `client-name:key` "
                          f"lines") from e
    return parse_file_text(text, str(path))


def _checked(keys: list[ApiKey], source: str) -> list[ApiKey]:
    seen: dict[bytes, str] = {}
    for key in keys:
        if key.digest in seen:
            raise ApiKeyError(f"{source}: one key is given twice (for {seen[key.digest]!r} "
                              f"and {key.client!r}): every key must name one client")
        seen[key.digest] = key.client
    if not keys:
        raise ApiKeyError(f"{source}: no keys; an empty key list would refuse every call")
    return keys


class ApiKeys:
    """The keys a server accepts, and which client each one names."""

    def __init__(self, keys: Iterable[ApiKey], *, file: Path | None = None,
                 extra: Sequence[ApiKey] = (), source: str = "API keys") -> None:
        self._keys = _checked(list(keys), source)
        self._file = file
        self._extra = list(extra)  # from the environment: kept across file reloads
        self._stamp = self._file_stamp()
        self._checked_at = time.monotonic()
        self._lock = threading.Lock()

    @classmethod
    def load(cls, file: str | Path | None = None,
             env: Mapping[str, str] | None = None) -> ApiKeys | None:
        """The keys of `file` and of `PDSERVE_API_KEYS` in `env` (default: the process
        environment); None when neither is set (the API then has no keys)."""
        env = os.environ if env is None else env
        from_env = parse_env_value(env.get(ENV_VAR, ""))
        path = Path(file) if file else None
        if path is None and not from_env:
            return None
        from_file = read_key_file(path) if path else []
        sources = " and ".join(s for s in (str(path) if path else "", ENV_VAR if from_env
                                           else "") if s)
        return cls(from_file + from_env, file=path, extra=from_env, source=sources)

    @property
    def clients(self) -> frozenset[str]:
        return frozenset(k.client for k in self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def client_of(self, key: str) -> str | None:
        """The client `key` names, or None. Every digest is compared, match or not."""
        self._maybe_reload()
        candidate = digest(key)
        found: str | None = None
        for entry in self._keys:
            if hmac.compare_digest(entry.digest, candidate) and found is None:
                found = entry.client
        return found

    def authenticate(self, token: str | None) -> str:
        """The client a bearer token names; `Unauthenticated` when it is missing or
        unknown."""
        if not token:
            raise Unauthenticated(MISSING_KEY)
        client = self.client_of(token)
        if client is None:
            raise Unauthenticated(INVALID_KEY)
        return client

    # -- rotation: re-read the file when it changes ------------------------------------
    def _file_stamp(self) -> tuple[int, int, int] | None:
        if self._file is None:
            return None
        try:
            st = self._file.stat()  # follows symlinks: a Kubernetes Secret's swap shows
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _maybe_reload(self) -> None:
        if self._file is None or time.monotonic() - self._checked_at < RELOAD_S:
            return
        with self._lock:
            self._checked_at = time.monotonic()
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                keys = _checked(read_key_file(self._file) + self._extra, str(self._file))
            except ApiKeyError as e:
                log.error("API keys not reloaded, the previous ones stay in force: %s", e)
                return
            self._keys = keys
            log.info("API keys reloaded from %s: %d keys for %d clients", self._file,
                     len(keys), len(self.clients))


# -- reading the bearer token ------------------------------------------------------------
def bearer_token(value: str | bytes | None) -> str | None:
    """The token of an `authorization: Bearer <token>` value (scheme case-insensitive)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def bearer_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer token in gRPC invocation metadata (keys are lowercase on the wire)."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return bearer_token(value)
    return None


def bearer_from_headers(headers: Mapping[str, str]) -> str | None:
    """The bearer token in HTTP headers (any case of `Authorization`)."""
    for key, value in headers.items():
        if key.lower() == "authorization":
            return bearer_token(value)
    return None


# -- making keys -------------------------------------------------------------------------
def new_key() -> str:
    """A fresh key: 32 random bytes, URL-safe (no `,` or `:`, so it fits both formats)."""
    return "pdsk_" + secrets.token_urlsafe(32)


def hashed_entry(client: str, key: str) -> str:
    """The file line that accepts `key` for `client` without storing the key."""
    return f"{client}:{HASHED_PREFIX}{hashlib.sha256(key.encode()).hexdigest()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.security.apikeys",
        description="Make an API key for a client: prints the key line (for the client and "
                    "a key file) and the hashed line (for a key file without the key).")
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="a fresh key for CLIENT")
    new.add_argument("client", help="the client's name (what per-client limits count)")
    args = parser.parse_args(argv)
    if not _NAME.fullmatch(args.client):
        print(f"error: client name {args.client!r}: 1-64 letters, digits or _.@-",
              file=sys.stderr)
        return 2
    key = new_key()
    print(f"{args.client}:{key}")
    print(hashed_entry(args.client, key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
