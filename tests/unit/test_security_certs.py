"""`pdserve certs init`: the files it writes, their modes, names and issuers; idempotence
and rotation."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from services.security import certs
from services.security.certs import CertsError, init
from services.security.tls import INTERNAL_NAME


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def sans(c: x509.Certificate) -> set[str]:
    return {str(n.value) for n in
            c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value}


def usages(c: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def signed_by(leaf: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        leaf.verify_directly_issued_by(ca)
    except Exception:
        return False
    return True


def test_writes_two_cas_and_the_role_certificates(tmp_path: Path) -> None:
    root = tmp_path / "certs"
    result = init(root, ["pdserve.example.com", "10.0.0.7"])
    assert not result.kept
    assert sorted(result.written) == sorted(certs.expected_files(root))
    internal_ca, public_ca = cert(root / "internal/ca.crt"), cert(root / "public/ca.crt")
    assert internal_ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert internal_ca.subject != public_ca.subject
    both = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    for role in ("router", "prefill", "decode"):
        leaf = cert(root / f"internal/{role}.crt")
        assert sans(leaf) == {INTERNAL_NAME, f"{role}.{INTERNAL_NAME}"}
        assert usages(leaf) == both
        assert signed_by(leaf, internal_ca) and not signed_by(leaf, public_ca)
    server, client = cert(root / "public/server.crt"), cert(root / "public/client.crt")
    assert sans(server) == {"pdserve.example.com", "10.0.0.7"}
    assert usages(server) == {ExtendedKeyUsageOID.SERVER_AUTH}
    assert usages(client) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    # A public client's certificate never chains to the internal CA.
    assert signed_by(client, public_ca) and not signed_by(client, internal_ca)


def test_keys_are_private(tmp_path: Path) -> None:
    root = tmp_path / "certs"
    init(root)
    for path in certs.expected_files(root):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o600 if path.suffix == ".key" else 0o644), path
    for folder in (root, root / "internal", root / "public"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not list(root.rglob(".*.tmp"))


def test_default_hosts_are_loopback(tmp_path: Path) -> None:
    init(tmp_path)
    assert sans(cert(tmp_path / "public/server.crt")) == {"localhost", "127.0.0.1", "::1"}


def test_idempotent_then_force_rotates(tmp_path: Path) -> None:
    init(tmp_path)
    before = {p: p.read_bytes() for p in certs.expected_files(tmp_path)}
    again = init(tmp_path)
    assert again.kept and not again.written
    assert {p: p.read_bytes() for p in before} == before
    rotated = init(tmp_path, force=True)
    assert not rotated.kept
    for path, old in before.items():
        assert path.read_bytes() != old, path  # new CAs and keys, every file


def test_a_partial_set_is_not_kept(tmp_path: Path) -> None:
    init(tmp_path)
    (tmp_path / "internal/decode.key").unlink()
    with pytest.raises(CertsError) as e:
        init(tmp_path)
    assert "missing: internal/decode.key" in str(e.value) and "--force" in str(e.value)
    assert not init(tmp_path, force=True).kept


def test_other_hosts_need_force(tmp_path: Path) -> None:
    init(tmp_path, ["a.example"])
    with pytest.raises(CertsError) as e:
        init(tmp_path, ["b.example"])
    assert "is for a.example, not b.example" in str(e.value)


def test_a_leaf_from_another_set_is_found(tmp_path: Path) -> None:
    init(tmp_path / "a")
    init(tmp_path / "b")
    for ext in ("crt", "key"):
        (tmp_path / f"a/internal/router.{ext}").write_bytes(
            (tmp_path / f"b/internal/router.{ext}").read_bytes())
    with pytest.raises(CertsError) as e:
        init(tmp_path / "a")
    assert "router.crt is not signed by" in str(e.value)


def test_expiring_sets_are_renewed_only_with_force(tmp_path: Path) -> None:
    init(tmp_path, days=3)  # inside the renewal window
    with pytest.raises(CertsError) as e:
        init(tmp_path)
    assert "expires on" in str(e.value)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert certs.main(["init", str(tmp_path), "--host", "h.example", "--days", "30"]) == 0
    assert "wrote 14 files" in capsys.readouterr().out
    assert certs.main(["init", str(tmp_path), "--host", "h.example"]) == 0
    assert "already there" in capsys.readouterr().out
    assert certs.main(["init", str(tmp_path), "--days", "0"]) == 1
    assert "--days must be at least 1" in capsys.readouterr().err


def test_a_stack_gets_its_own_ca_and_removes_it() -> None:
    from services.security.policy import internal_tls
    from services.security.stack import StackCertificates, has_internal_tls
    from services.security.tls import load
    from services.server.settings import ServerConfig

    stack = StackCertificates()
    try:
        assert stat.S_IMODE(stack.directory.stat().st_mode) == 0o700
        for role in ("router", "prefill", "decode"):
            server = ServerConfig().model_copy(update=stack.settings(role))
            assert has_internal_tls(server)
            files = internal_tls(server)
            assert files is not None and files.cert is not None
            assert files.cert.name == f"{role}.crt"
            load(files, need_ca=True, need_cert=True)
        assert not has_internal_tls(ServerConfig())
    finally:
        stack.close()
    assert not stack.directory.exists()
