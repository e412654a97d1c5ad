"""What a pdserve process's settings say about who may connect: the public API's
credentials (`PublicAuth`), the internal channels' mTLS files (`internal_tls`), and the
rule that the public API never serves beyond loopback unauthenticated unless told to
(`check_public_bind`). `services/server/` applies them to ports, calls and channels.

Settings objects are read by attribute, so any config that has the fields works:
`tls_cert_file`, `tls_key_file`, `tls_client_ca_file`, `api_keys_file` (public API) and
`internal_tls_ca_file`, `internal_tls_cert_file`, `internal_tls_key_file` (internal).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

from services.security.apikeys import ApiKeyError, ApiKeys
from services.security.tls import TLSConfigError, TLSFiles, load, uvicorn_options

log = logging.getLogger(__name__)

PUBLIC_SETTINGS = ("--tls-client-ca-file", "--tls-cert-file", "--tls-key-file")
INTERNAL_SETTINGS = ("--internal-tls-ca-file", "--internal-tls-cert-file",
                     "--internal-tls-key-file")


class InsecureBindError(RuntimeError):
    """The public API would serve beyond loopback without API keys or TLS."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere, or "" / "0.0.0.0"-like wildcards


@dataclass(frozen=True, slots=True)
class PublicAuth:
    """How the public API authenticates: API keys, TLS (with client certificates when a
    client CA is set), both, or neither."""

    keys: ApiKeys | None
    tls: TLSFiles | None

    @classmethod
    def of(cls, config: Any) -> PublicAuth:
        """From settings (`api_keys_file` plus `PDSERVE_API_KEYS`, `tls_*_file`)."""
        keys = ApiKeys.load(getattr(config, "api_keys_file", "") or None)
        files = TLSFiles.of(getattr(config, "tls_client_ca_file", ""),
                            getattr(config, "tls_cert_file", ""),
                            getattr(config, "tls_key_file", ""), PUBLIC_SETTINGS)
        return cls(keys, files if files.configured else None)

    @property
    def requires_client_cert(self) -> bool:
        return self.tls is not None and self.tls.ca is not None

    @property
    def authenticated(self) -> bool:
        return self.keys is not None or self.requires_client_cert

    def uvicorn_options(self) -> dict[str, object]:
        """uvicorn's HTTPS options (empty without TLS)."""
        if self.tls is None:
            return {}
        return uvicorn_options(self.tls, require_client_auth=self.requires_client_cert)


def check_public_bind(host: str, auth: PublicAuth, allow_insecure: bool,
                      what: str = "the public API") -> None:
    """Refuse to serve `what` beyond loopback with neither API keys nor TLS, unless
    `allow_insecure` (then log a warning)."""
    if is_loopback(host) or auth.keys is not None or auth.tls is not None:
        return
    message = (f"{what} would listen on {host or 'every interface'} with neither API keys "
               f"nor TLS: anyone who reaches it could use it")
    if not allow_insecure:
        raise InsecureBindError(f"{message}. Set --api-keys-file (or PDSERVE_API_KEYS) "
                                f"and/or --tls-cert-file/--tls-key-file, bind 127.0.0.1, or "
                                f"pass --allow-insecure to accept this")
    log.warning("%s (--allow-insecure)", message)


def internal_tls(config: Any) -> TLSFiles | None:
    """The internal channels' mTLS files from settings; None when none is set."""
    files = TLSFiles.of(getattr(config, "internal_tls_ca_file", ""),
                        getattr(config, "internal_tls_cert_file", ""),
                        getattr(config, "internal_tls_key_file", ""), INTERNAL_SETTINGS)
    return files if files.configured else None


CONFIG_ERRORS = (ApiKeyError, TLSConfigError, InsecureBindError)


def preflight(config: Any, internal: bool = False) -> None:
    """Check a process's security settings before anything slow starts (an engine takes
    a minute): every file loads and the public bind rule holds. Raises one of
    `CONFIG_ERRORS`, whose message says what to fix."""
    files = internal_tls(config)
    if files is not None:
        load(files, need_ca=True, need_cert=True)
    if internal:
        return
    auth = PublicAuth.of(config)
    check_public_bind(getattr(config, "host", ""), auth, getattr(config, "allow_insecure",
                                                                 False))
    if auth.tls is not None:
        load(auth.tls, need_ca=auth.requires_client_cert, need_cert=True)
