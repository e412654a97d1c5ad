"""TLS on a server's ports: the public API's (server TLS, client certificates when a
client CA is set) and the internal one (mutual TLS, always, between pdserve processes).
Works on asyncio and blocking servers alike (the KV receivers are blocking)."""

from __future__ import annotations

from typing import TypeAlias

import grpc

from services.security.policy import PublicAuth
from services.security.tls import TLSFiles, internal_server_credentials, server_credentials

AnyServer: TypeAlias = grpc.Server | grpc.aio.Server


def add_public_port(server: AnyServer, address: str, auth: PublicAuth) -> int:
    """Bind `address` on `server`, with TLS when `auth` has it; the port bound."""
    if auth.tls is None:
        return int(server.add_insecure_port(address))
    creds = server_credentials(auth.tls, require_client_auth=auth.requires_client_cert)
    return int(server.add_secure_port(address, creds))


def add_internal_port(server: AnyServer, address: str, tls: TLSFiles | None) -> int:
    """Bind an internal server's port (a worker's API, a KV receiver): mTLS with `tls`,
    plaintext without; the port bound."""
    if tls is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, internal_server_credentials(tls)))
