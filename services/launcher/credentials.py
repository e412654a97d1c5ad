"""What a `pdserve up` stack is secured with: the cluster secret its records in Redis are
signed under, and the CA of its internal channels (mutual TLS)."""

from __future__ import annotations

import logging

from services.launcher.settings import Stack
from services.registry.config import ClusterStateConfig
from services.registry.signing import load_secret, new_secret
from services.security.stack import StackCertificates, has_internal_tls

log = logging.getLogger(__name__)


def cluster_secret(cluster: ClusterStateConfig) -> str:
    """The stack's cluster secret: the configured one, none when unsigned records are
    explicitly allowed, else a new one for this stack."""
    key = load_secret(cluster.cluster_secret.get_secret_value(), cluster.cluster_secret_file)
    if key is not None:
        return key.decode()
    if cluster.allow_unsigned_records:
        log.warning("pdserve up: cluster records are NOT signed (--allow-unsigned-records): "
                    "anyone who can write to Redis can register a worker or stop the stack")
        return ""
    return new_secret()


def stack_certificates(stack: Stack) -> StackCertificates | None:
    """A CA for this stack (mTLS on its internal channels) unless it has internal TLS
    files of its own or is told not to. Only on a local cluster: actors on other nodes
    could not read files made here (there, give every node the same files)."""
    if has_internal_tls(stack.server) or not stack.launcher.stack_tls:
        return None
    if stack.launcher.ray_address:
        log.warning("pdserve up on a Ray cluster without --internal-tls-*-file: the "
                    "internal channels (router -> workers, KV transfers) are not encrypted")
        return None
    return StackCertificates()
