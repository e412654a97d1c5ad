"""TLS credentials for pdserve's gRPC servers and channels (and uvicorn's HTTPS).

Two kinds of channel use them:

- the public API: the server's certificate and key, and optionally a CA whose client
  certificates it requires (mTLS); clients trust the server's CA (or the system's roots);
- internal channels (router -> workers, the KV transports' gRPC): always mutual. Every
  internal certificate carries the DNS name `INTERNAL_NAME`, and every internal client
  checks it (`INTERNAL_CHANNEL_OPTIONS`) instead of the peer's address: workers are
  dialled by pod IP or ephemeral host:port, which no certificate can name in advance.

Files are read and checked when credentials are made (at start), and every problem is
reported as a `TLSConfigError` naming the file, the setting it came from and what to do,
instead of the handshake failures gRPC would report later without saying why.
"""

from __future__ import annotations

import datetime
import logging
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = logging.getLogger(__name__)

INTERNAL_NAME = "pdserve.internal"
# Internal clients verify the server's certificate against this name, whatever address
# they dial.
INTERNAL_CHANNEL_OPTIONS: tuple[tuple[str, str], ...] = (
    ("grpc.ssl_target_name_override", INTERNAL_NAME),
)
MAKE_CERTS = "make development certificates with `pdserve certs init DIR`"


class TLSConfigError(ValueError):
    """A TLS file that is missing, unreadable or not what it should be."""


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files: `ca` (the CA that peers' certificates must chain to), `cert` (this
    side's certificate chain) and `key` (its private key). `settings` names the setting
    each came from, for error messages."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    settings: tuple[str, str, str] = ("the CA file", "the certificate file", "the key file")

    @classmethod
    def of(cls, ca: str | Path | None, cert: str | Path | None, key: str | Path | None,
           settings: tuple[str, str, str] | None = None) -> TLSFiles:
        """From settings values, where "" means not set."""
        def path(p: str | Path | None) -> Path | None:
            return Path(p) if p else None

        return cls(path(ca), path(cert), path(key)) if settings is None else cls(
            path(ca), path(cert), path(key), settings)

    @classmethod
    def in_dir(cls, directory: str | Path, name: str) -> TLSFiles:
        """`ca.crt`, `<name>.crt`, `<name>.key` in `directory` (the layout of
        `pdserve certs init`)."""
        d = Path(directory)
        return cls(d / "ca.crt", d / f"{name}.crt", d / f"{name}.key",
                   (str(d / "ca.crt"), str(d / f"{name}.crt"), str(d / f"{name}.key")))

    @property
    def configured(self) -> bool:
        return any((self.ca, self.cert, self.key))


@dataclass(frozen=True, slots=True)
class TLSMaterial:
    """The PEM bytes of a checked `TLSFiles`."""

    ca: bytes | None
    cert: bytes | None
    key: bytes | None


def _read(path: Path, what: str, setting: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TLSConfigError(f"{what} {path} (from {setting}) does not exist: point "
                             f"{setting} at a PEM file, or {MAKE_CERTS}") from None
    except OSError as e:
        raise TLSConfigError(f"{what} {path} (from {setting}) cannot be read "
                             f"({e.strerror}): check its owner and mode") from e
    if not data.strip():
        raise TLSConfigError(f"{what} {path} (from {setting}) is empty")
    return data


def _certificates(data: bytes, path: Path, what: str, setting: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TLSConfigError(
            f"{what} {path} (from {setting}) holds no PEM certificate (a block starting "
            f"`-----BEGIN CERTIFICATE-----`); a private key given here by mistake? "
            f"{MAKE_CERTS}") from None
    now = datetime.datetime.now(datetime.UTC)
    for cert in certs[:1]:
        if cert.not_valid_after_utc < now:
            raise TLSConfigError(f"{what} {path} (from {setting}) expired on "
                                 f"{cert.not_valid_after_utc:%Y-%m-%d}: issue a new one "
                                 f"(`pdserve certs init DIR --force` rotates a development "
                                 f"set)")
        if cert.not_valid_before_utc > now:
            raise TLSConfigError(f"{what} {path} (from {setting}) is not valid before "
                                 f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: check "
                                 f"this machine's clock")
    return certs


def _check_key(data: bytes, path: Path, setting: str, cert: x509.Certificate,
               cert_path: Path) -> None:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise TLSConfigError(
            f"key file {path} (from {setting}) holds no unencrypted PEM private key (a "
            f"block starting `-----BEGIN PRIVATE KEY-----`, `... EC PRIVATE KEY` or "
            f"`... RSA PRIVATE KEY`); a certificate given here by mistake, or a "
            f"passphrase-protected key?") from None
    raw = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*raw) != cert.public_key().public_bytes(*raw):
        raise TLSConfigError(f"key file {path} does not belong to certificate {cert_path}: "
                             f"give the key the certificate was issued for")
    mode = path.stat().st_mode
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        log.warning("private key %s is readable by every user (mode %o): chmod 600 it",
                    path, stat.S_IMODE(mode))


def load(files: TLSFiles, *, need_ca: bool, need_cert: bool) -> TLSMaterial:
    """Read and check `files`: each PEM parses, the leaf certificate is in its validity
    period, and the key is the certificate's. `need_*` says what this side requires."""
    ca_setting, cert_setting, key_setting = files.settings
    if need_ca and files.ca is None:
        raise TLSConfigError(f"{ca_setting} is required here (the CA that peers' "
                             f"certificates are checked against)")
    if need_cert and (files.cert is None or files.key is None):
        missing = cert_setting if files.cert is None else key_setting
        raise TLSConfigError(f"{missing} is required here (this side's certificate and its "
                             f"key): {MAKE_CERTS}")
    if (files.cert is None) != (files.key is None):
        missing = cert_setting if files.cert is None else key_setting
        raise TLSConfigError(f"{missing} is missing: a certificate and its key go together")
    ca = cert = key = None
    if files.ca is not None:
        ca = _read(files.ca, "CA file", ca_setting)
        _certificates(ca, files.ca, "CA file", ca_setting)
    if files.cert is not None and files.key is not None:
        cert = _read(files.cert, "certificate file", cert_setting)
        chain = _certificates(cert, files.cert, "certificate file", cert_setting)
        key = _read(files.key, "key file", key_setting)
        _check_key(key, files.key, key_setting, chain[0], files.cert)
    return TLSMaterial(ca, cert, key)


def server_credentials(files: TLSFiles, require_client_auth: bool) -> grpc.ServerCredentials:
    """A gRPC server's TLS: its certificate and key; with `require_client_auth`, only
    clients with a certificate from `files.ca` get past the handshake."""
    material = load(files, need_ca=require_client_auth, need_cert=True)
    assert material.cert is not None and material.key is not None
    return grpc.ssl_server_credentials([(material.key, material.cert)],
                                       root_certificates=material.ca,
                                       require_client_auth=require_client_auth)


def channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials:
    """A gRPC client's TLS: trust `files.ca` (the system's roots when unset) and present
    `files.cert` when set (mTLS)."""
    material = load(files, need_ca=False, need_cert=False)
    return grpc.ssl_channel_credentials(root_certificates=material.ca,
                                        private_key=material.key,
                                        certificate_chain=material.cert)


def internal_server_credentials(files: TLSFiles) -> grpc.ServerCredentials:
    """An internal server (worker API, KV receiver): mutual TLS, always."""
    return server_credentials(files, require_client_auth=True)


def internal_channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials:
    """An internal client: the internal CA and this process's own certificate."""
    load(files, need_ca=True, need_cert=True)
    return channel_credentials(files)


def uvicorn_options(files: TLSFiles, require_client_auth: bool) -> dict[str, object]:
    """uvicorn's keyword arguments for HTTPS with the same files as the gRPC port."""
    import ssl

    load(files, need_ca=require_client_auth, need_cert=True)
    options: dict[str, object] = {"ssl_certfile": str(files.cert),
                                  "ssl_keyfile": str(files.key)}
    if files.ca is not None:
        options["ssl_ca_certs"] = str(files.ca)
        options["ssl_cert_reqs"] = (ssl.CERT_REQUIRED if require_client_auth
                                    else ssl.CERT_OPTIONAL)
    return options
