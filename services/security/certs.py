"""`pdserve certs init DIR`: a development certificate set for a pdserve deployment.

Two certificate authorities, so that a certificate made for a client of the public API
can never open an internal port:

    DIR/internal/ca.crt, ca.key              the internal CA
    DIR/internal/{router,prefill,decode}.crt/.key
                                             mTLS between router, workers and the KV
                                             transports; each carries the DNS name
                                             pdserve.internal (what internal clients check)
                                             and <role>.pdserve.internal
    DIR/public/ca.crt, ca.key                the public CA
    DIR/public/server.crt, server.key        the public API's certificate, for the hosts
                                             given (default localhost, 127.0.0.1, ::1)
    DIR/public/client.crt, client.key        a client certificate for mTLS on the public API

Keys are ECDSA P-256, written with mode 0600 (the folders 0700). Running it again keeps
a complete, valid set (it is idempotent); `--force` writes a new set, CAs included, which
is how a development set is rotated. Production deployments bring their own CA (the Helm
chart takes certificates from Secrets or cert-manager).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.security.tls import INTERNAL_NAME, TLSConfigError, TLSFiles, load

INTERNAL_ROLES = ("router", "prefill", "decode")
PUBLIC_LEAVES = ("server", "client")
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_DAYS = 365
CA_DAYS = 5 * 365
RENEW_WITHIN = datetime.timedelta(days=7)  # a set closer than this to expiry is renewed


class CertsError(Exception):
    """A certificate folder that cannot be used as it is; the message says what to do."""


@dataclass
class CertsResult:
    directory: Path
    written: list[Path] = field(default_factory=list)
    kept: bool = False  # a complete, valid set was already there


def internal_files(directory: str | Path, role: str) -> TLSFiles:
    """The internal CA, certificate and key of `role` in a `certs init` folder."""
    return TLSFiles.in_dir(Path(directory) / "internal", role)


def public_files(directory: str | Path, leaf: str) -> TLSFiles:
    """The public CA and the `server` or `client` certificate of a `certs init` folder."""
    return TLSFiles.in_dir(Path(directory) / "public", leaf)


# -- making certificates -----------------------------------------------------------------
def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey,
             days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            # A minute back, for peers whose clocks run a little behind.
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key),
                           critical=False))


def make_ca(common_name: str, days: int = CA_DAYS
            ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    name = _name(common_name)
    cert = (_builder(name, name, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_leaf(common_name: str, hosts: Sequence[str], usages: Sequence[x509.ObjectIdentifier],
              ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], days: int
              ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate signed by `ca` for `hosts` (DNS names or IP addresses)."""
    ca_cert, ca_key = ca
    key = _key()
    builder = (_builder(_name(common_name), ca_cert.subject, key.public_key(), days)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_agreement=True,
                                            key_cert_sign=False, crl_sign=False,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca_key.public_key()), critical=False))
    if hosts:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


# -- writing them ------------------------------------------------------------------------
def _write(path: Path, data: bytes, mode: int) -> None:
    """Write atomically with `mode` from the start (a key is never readable by others,
    not even for a moment)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _save(directory: Path, stem: str, cert: x509.Certificate,
          key: ec.EllipticCurvePrivateKey, result: CertsResult) -> None:
    crt, pem = directory / f"{stem}.crt", directory / f"{stem}.key"
    _write(pem, key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()), 0o600)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    result.written += [crt, pem]


def expected_files(directory: Path) -> list[Path]:
    internal, public = directory / "internal", directory / "public"
    stems = [(internal, s) for s in ("ca", *INTERNAL_ROLES)] + [
        (public, s) for s in ("ca", *PUBLIC_LEAVES)]
    return [d / f"{s}.{ext}" for d, s in stems for ext in ("crt", "key")]


def _leaf_hosts(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n.value) for n in san}


def _verify_signed(ca_path: Path, leaf_path: Path) -> None:
    ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
    leaf = x509.load_pem_x509_certificate(leaf_path.read_bytes())
    try:
        leaf.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as e:
        raise CertsError(f"{leaf_path} is not signed by {ca_path} ({e})") from e


def _existing_set_is_usable(directory: Path, hosts: Sequence[str]) -> bool:
    """True when a complete set for `hosts` is there, valid for more than a week; False
    when there is none; `CertsError` when a set is there but cannot be kept."""
    paths = expected_files(directory)
    present = [p for p in paths if p.exists()]
    if not present:
        return False
    missing = [str(p.relative_to(directory)) for p in paths if not p.exists()]
    if missing:
        raise CertsError(f"{directory} holds part of a certificate set (missing: "
                         f"{', '.join(missing)}): pass --force to write a new set")
    soon = datetime.datetime.now(datetime.UTC) + RENEW_WITHIN
    for kind, leaves in (("internal", INTERNAL_ROLES), ("public", PUBLIC_LEAVES)):
        for leaf in leaves:
            files = TLSFiles.in_dir(directory / kind, leaf)
            try:
                load(files, need_ca=True, need_cert=True)
            except TLSConfigError as e:
                raise CertsError(f"{e}; pass --force to write a new set") from e
            assert files.ca is not None and files.cert is not None
            _verify_signed(files.ca, files.cert)
            for path in (files.ca, files.cert):
                cert = x509.load_pem_x509_certificate(path.read_bytes())
                if cert.not_valid_after_utc < soon:
                    raise CertsError(f"{path} expires on {cert.not_valid_after_utc:%Y-%m-%d}"
                                     f": pass --force to rotate the set")
    have = _leaf_hosts(directory / "public" / "server.crt")
    wanted = {str(_san(h).value) for h in hosts}
    if have != wanted:
        raise CertsError(f"{directory}/public/server.crt is for {', '.join(sorted(have))}, "
                         f"not {', '.join(sorted(wanted))}: pass --force to write a new set")
    return True


def init(directory: str | Path, hosts: Sequence[str] = DEFAULT_HOSTS, *, force: bool = False,
         days: int = DEFAULT_DAYS) -> CertsResult:
    """Write a development set into `directory` (see the module's docstring)."""
    if days < 1:
        raise CertsError("--days must be at least 1")
    if not hosts:
        raise CertsError("the public server certificate needs at least one --host")
    root = Path(directory)
    result = CertsResult(root)
    if not force and _existing_set_is_usable(root, hosts):
        result.kept = True
        return result
    for sub in (root, root / "internal", root / "public"):
        sub.mkdir(parents=True, exist_ok=True)
        os.chmod(sub, 0o700)
    both = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
    internal_ca = make_ca("pdserve internal CA")
    _save(root / "internal", "ca", *internal_ca, result)
    for role in INTERNAL_ROLES:
        # Router, prefill and decode are each both a server and a client of the others.
        leaf = make_leaf(f"pdserve-{role}", (INTERNAL_NAME, f"{role}.{INTERNAL_NAME}"), both,
                         internal_ca, days)
        _save(root / "internal", role, *leaf, result)
    public_ca = make_ca("pdserve public CA")
    _save(root / "public", "ca", *public_ca, result)
    server = make_leaf("pdserve-server", hosts, (ExtendedKeyUsageOID.SERVER_AUTH,),
                       public_ca, days)
    _save(root / "public", "server", *server, result)
    client = make_leaf("pdserve-client", (), (ExtendedKeyUsageOID.CLIENT_AUTH,), public_ca,
                       days)
    _save(root / "public", "client", *client, result)
    return result


# -- command line --------------------------------------------------------------------------
def add_certs_parser(subparsers: argparse._SubParsersAction) -> None:
    """`certs init` on a CLI's subparsers (`pdserve certs init`)."""
    certs = subparsers.add_parser("certs", help="development TLS certificates")
    sub = certs.add_subparsers(dest="certs_command", required=True)
    init_parser = sub.add_parser(
        "init", help="write a development CA and per-role certificates into DIR",
        description=(__doc__ or "").split("\n\n", 1)[1])
    init_parser.formatter_class = argparse.RawDescriptionHelpFormatter
    init_parser.add_argument("dir", help="folder to write (created if missing)")
    init_parser.add_argument("--host", action="append", dest="hosts", metavar="HOST",
                             help="a DNS name or IP address of the public server "
                                  "certificate (repeatable; default: localhost, 127.0.0.1, "
                                  "::1)")
    init_parser.add_argument("--days", type=int, default=DEFAULT_DAYS,
                             help=f"validity of the leaf certificates (default "
                                  f"{DEFAULT_DAYS}; the CAs get {CA_DAYS})")
    init_parser.add_argument("--force", action="store_true",
                             help="write a new set even if one is there (rotation)")
    init_parser.set_defaults(func=cmd_certs_init)


def cmd_certs_init(args: argparse.Namespace) -> int:
    try:
        result = init(args.dir, args.hosts or DEFAULT_HOSTS, force=args.force, days=args.days)
    except (CertsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result.kept:
        print(f"{result.directory}: a complete, valid set is already there (--force "
              f"rotates it)")
    else:
        print(f"{result.directory}: wrote {len(result.written)} files "
              f"(internal/: CA, router, prefill, decode; public/: CA, server, client)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.security.certs")
    add_certs_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["certs", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
