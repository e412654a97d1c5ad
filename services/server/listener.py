"""How a server's gRPC port is secured and who gets through it: the public API's TLS
(with client certificates when a client CA is set) and API keys, or internal mTLS on a
worker's port; and the interceptors every server has. The policy (whose credentials
count, the public bind rule) is `services/security/policy.py`'s."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from services.security.policy import PublicAuth, check_public_bind, internal_tls, is_loopback
from services.security.tls import TLSFiles
from services.server.auth import ApiKeyInterceptor
from services.server.errors import ErrorInterceptor
from services.server.ports import add_internal_port, add_public_port
from services.server.settings import ServerConfig

log = logging.getLogger(__name__)

def interceptors(auth: PublicAuth | None) -> list[grpc.aio.ServerInterceptor]:
    """A server's interceptors: statuses for exceptions first (it answers what the
    others raise too), then the public API's key check when it has keys."""
    keys = [ApiKeyInterceptor(auth.keys)] if auth is not None and auth.keys is not None else []
    return [ErrorInterceptor(), *keys]


@dataclass(frozen=True, slots=True)
class Listener:
    """A server's gRPC port: the public API's credentials (`auth`), or internal mTLS
    (`auth` None: a worker's port), and whether it serves reflection."""

    auth: PublicAuth | None
    internal_tls: TLSFiles | None
    reflection: bool

    @classmethod
    def public(cls, config: ServerConfig) -> Listener:
        """The public API's port; refuses (`InsecureBindError`) to serve beyond loopback
        unauthenticated unless `allow_insecure`."""
        auth = PublicAuth.of(config)
        check_public_bind(config.host, auth, config.allow_insecure)
        return cls(auth, None, reflection=True)

    @classmethod
    def internal(cls, config: ServerConfig) -> Listener:
        """A worker's port: internal mTLS, reflection only with `internal_reflection`."""
        files = internal_tls(config)
        if files is None and not is_loopback(config.host):
            log.warning("worker port on %s without internal TLS: anyone who reaches it "
                        "can call it (set --internal-tls-*-file)", config.host)
        return cls(None, files, reflection=config.internal_reflection)

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if self.auth is None:
            return add_internal_port(server, address, self.internal_tls)
        return add_public_port(server, address, self.auth)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return interceptors(self.auth)
