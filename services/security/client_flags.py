"""The credentials flags of pdserve's clients (`pdserve generate`, `info`, `bench`): an
API key and TLS, with the same names everywhere."""

from __future__ import annotations

import argparse
import os
from typing import Any

from services.security.tls import TLSFiles

API_KEY_ENV = "PDSERVE_API_KEY"


def add_client_security_flags(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--api-key", default=None,
                        help=f"the API key, sent as `authorization: Bearer <key>` "
                             f"[env {API_KEY_ENV}]")
    parser.add_argument("--tls", action="store_true",
                        help="TLS to the server, trusting the system's CAs (implied by "
                             "--tls-ca-file)")
    parser.add_argument("--tls-ca-file", default="",
                        help="TLS to the server, trusting this CA (PEM)")
    parser.add_argument("--tls-cert-file", default="",
                        help="a client certificate, for servers that require one (mTLS)")
    parser.add_argument("--tls-key-file", default="", help="the client certificate's key")


def client_security(args: argparse.Namespace) -> dict[str, Any]:
    """`PdserveClient` keyword arguments from the flags."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, "")
    files = TLSFiles.of(args.tls_ca_file, args.tls_cert_file, args.tls_key_file,
                        ("--tls-ca-file", "--tls-cert-file", "--tls-key-file"))
    tls = files if (args.tls or files.configured) else None
    return {"api_key": api_key, "tls": tls}
