"""Loading TLS files: what a good set gives, and that each kind of mistake is reported
with the file, the setting it came from and what to do. Also the public-bind rule."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from services.security import certs
from services.security.policy import (
    INTERNAL_SETTINGS,
    InsecureBindError,
    PublicAuth,
    check_public_bind,
    internal_tls,
    is_loopback,
)
from services.security.tls import TLSConfigError, TLSFiles, load, uvicorn_options


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("certs")
    certs.init(root)
    return root


def internal(root: Path, role: str = "router") -> TLSFiles:
    files = certs.internal_files(root, role)
    return TLSFiles(files.ca, files.cert, files.key, INTERNAL_SETTINGS)


def test_a_good_set_loads(certs_dir: Path) -> None:
    material = load(internal(certs_dir), need_ca=True, need_cert=True)
    assert material.ca and b"BEGIN CERTIFICATE" in material.ca
    assert material.key and b"PRIVATE KEY" in material.key


def error(files: TLSFiles, need_ca: bool = True, need_cert: bool = True) -> str:
    with pytest.raises(TLSConfigError) as e:
        load(files, need_ca=need_ca, need_cert=need_cert)
    return str(e.value)


def test_missing_file_names_the_setting(certs_dir: Path, tmp_path: Path) -> None:
    files = internal(certs_dir)
    message = error(TLSFiles(tmp_path / "nope.crt", files.cert, files.key, INTERNAL_SETTINGS))
    assert str(tmp_path / "nope.crt") in message
    assert "--internal-tls-ca-file" in message and "pdserve certs init" in message


def test_required_parts(certs_dir: Path) -> None:
    files = internal(certs_dir)
    assert "--internal-tls-ca-file is required" in error(
        TLSFiles(None, files.cert, files.key, INTERNAL_SETTINGS))
    assert "--internal-tls-key-file is required" in error(
        TLSFiles(files.ca, files.cert, None, INTERNAL_SETTINGS))
    assert "a certificate and its key go together" in error(
        TLSFiles(files.ca, None, files.key, INTERNAL_SETTINGS), need_cert=False)


def test_swapped_certificate_and_key(certs_dir: Path) -> None:
    files = internal(certs_dir)
    message = error(TLSFiles(files.ca, files.key, files.cert, INTERNAL_SETTINGS))
    assert "holds no PEM certificate" in message and "--internal-tls-cert-file" in message


def test_key_of_another_certificate(certs_dir: Path) -> None:
    files = internal(certs_dir)
    other = certs.internal_files(certs_dir, "decode").key
    message = error(TLSFiles(files.ca, files.cert, other, INTERNAL_SETTINGS))
    assert f"key file {other} does not belong to certificate {files.cert}" in message


def test_a_key_where_the_ca_should_be(certs_dir: Path) -> None:
    files = internal(certs_dir)
    assert "CA file" in error(TLSFiles(files.key, files.cert, files.key, INTERNAL_SETTINGS))


def test_empty_and_garbage_files(certs_dir: Path, tmp_path: Path) -> None:
    files = internal(certs_dir)
    empty = tmp_path / "empty.pem"
    empty.write_text("\n")
    assert "is empty" in error(TLSFiles(empty, files.cert, files.key))
    junk = tmp_path / "junk.key"
    junk.write_text("-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")
    assert "holds no unencrypted PEM private key" in error(
        TLSFiles(files.ca, files.cert, junk))


def _self_signed(tmp_path: Path, start: datetime.datetime, end: datetime.datetime
                 ) -> TLSFiles:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "old")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(start).not_valid_after(end).sign(key, hashes.SHA256()))
    crt, pem = tmp_path / "old.crt", tmp_path / "old.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    pem.chmod(0o600)
    return TLSFiles(None, crt, pem, ("ca", "--tls-cert-file", "key"))


def test_expired_and_not_yet_valid(tmp_path: Path) -> None:
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)
    expired = _self_signed(tmp_path, now - 10 * day, now - day)
    message = error(expired, need_ca=False)
    assert "expired on" in message and "--tls-cert-file" in message and "--force" in message
    future = _self_signed(tmp_path, now + day, now + 10 * day)
    assert "check this machine's clock" in error(future, need_ca=False)


def test_world_readable_key_is_warned_about(certs_dir: Path, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    files = internal(certs_dir)
    assert files.key is not None
    loose = tmp_path / "loose.key"
    loose.write_bytes(files.key.read_bytes())
    loose.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        load(TLSFiles(files.ca, files.cert, loose), need_ca=True, need_cert=True)
    assert "readable by every user" in caplog.text


def test_uvicorn_options_require_client_certificates_with_a_client_ca(certs_dir: Path) -> None:
    import ssl

    server = certs.public_files(certs_dir, "server")
    assert uvicorn_options(TLSFiles(None, server.cert, server.key), False) == {
        "ssl_certfile": str(server.cert), "ssl_keyfile": str(server.key)}
    mutual = uvicorn_options(server, True)
    assert mutual["ssl_ca_certs"] == str(server.ca)
    assert mutual["ssl_cert_reqs"] == ssl.CERT_REQUIRED


class Settings:
    def __init__(self, **fields: str) -> None:
        self.__dict__.update(fields)


def test_settings_to_credentials(certs_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    server = certs.public_files(certs_dir, "server")
    auth = PublicAuth.of(Settings(tls_cert_file=str(server.cert), tls_key_file=str(server.key),
                                  tls_client_ca_file="", api_keys_file=""))
    assert auth.tls is not None and auth.keys is None
    assert not auth.requires_client_cert and not auth.authenticated
    assert PublicAuth.of(Settings()).tls is None
    monkeypatch.setenv("PDSERVE_API_KEYS", "alice:alice-key-0123456789ab")
    keyed = PublicAuth.of(Settings())
    assert keyed.authenticated and keyed.keys is not None
    files = internal_tls(Settings(internal_tls_ca_file="a", internal_tls_cert_file="b",
                                  internal_tls_key_file="c"))
    assert files == TLSFiles(Path("a"), Path("b"), Path("c"), INTERNAL_SETTINGS)
    assert internal_tls(Settings()) is None


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.1", False), ("example", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_public_bind_rule(certs_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    bare = PublicAuth(None, None)
    check_public_bind("127.0.0.1", bare, allow_insecure=False)  # loopback: fine
    with pytest.raises(InsecureBindError) as e:
        check_public_bind("0.0.0.0", bare, allow_insecure=False)
    assert "--allow-insecure" in str(e.value) and "--api-keys-file" in str(e.value)
    with caplog.at_level(logging.WARNING):
        check_public_bind("0.0.0.0", bare, allow_insecure=True)
    assert "neither API keys nor TLS" in caplog.text
    server = certs.public_files(certs_dir, "server")
    check_public_bind("0.0.0.0", PublicAuth(None, server), allow_insecure=False)
