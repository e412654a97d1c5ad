"""gRPC plumbing of the KV transports: the service's method names, channel and server
options, and error text. Every KV channel and server port is made through this module,
with the credentials and message limits of `services/server/` (internal mTLS)."""

from __future__ import annotations

from typing import Any

import grpc
import torch

from services.kv.transport.spec import TransportConfig
from services.security.policy import INTERNAL_SETTINGS
from services.security.tls import TLSFiles
from services.server.channels import dial_blocking, message_limits
from services.server.ports import add_internal_port

SERVICE = "pdserve.v1.KVTransfer"
PUSH = f"/{SERVICE}/Push"  # client stream of frames -> one ACK (gRPC transport)
PAIR = f"/{SERVICE}/Pair"  # bidirectional control stream of a torch pair group
SHM = f"/{SERVICE}/Shm"  # bidirectional control stream of a same-host transfer


def channel_options(config: TransportConfig) -> list[tuple[str, Any]]:
    """Client options: explicit message limits and keepalive pings so a peer that
    vanished without closing its socket is noticed."""
    return [
        *message_limits(config.max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(config: TransportConfig) -> list[tuple[str, Any]]:
    return [
        *message_limits(config.max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),  # two receivers must never share a port silently
    ]


def tls_files(config: TransportConfig) -> TLSFiles | None:
    """The internal mTLS files of `config` (None: plaintext)."""
    if not config.tls:
        return None
    return TLSFiles.of(config.tls_ca_file, config.tls_cert_file, config.tls_key_file,
                       INTERNAL_SETTINGS)


def open_channel(peer: str, config: TransportConfig) -> grpc.Channel:
    """A blocking channel to a KV receiver: mutual TLS when the config has the files."""
    return dial_blocking(peer, tls_files(config), channel_options(config))


def bind(server: grpc.Server, host: str, port: int, config: TransportConfig) -> str:
    """Bind `server` to host:port; returns the "host:port" actually bound. With the TLS
    files, the port requires a client certificate from the internal CA: the torch
    transport's rendezvous and a peer's HELLO travel only over such an authenticated
    stream, so an unauthenticated peer never learns the store address."""
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    bound = add_internal_port(server, f"{bracketed}:{port}", tls_files(config))
    if not bound:
        raise OSError(f"cannot bind KV receiver to {bracketed}:{port}")
    return f"{bracketed}:{bound}"


def rpc_error_text(err: grpc.RpcError) -> str:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return f"{code.name if code else 'UNKNOWN'}: {details}"


def host_tensor(tensor: torch.Tensor, event: torch.cuda.Event | None) -> torch.Tensor:
    """A contiguous CPU copy-or-view of a layer, waiting for the producer's CUDA work."""
    if tensor.is_cuda:  # untested here: needs a GPU; the event orders us after index_select
        if event is not None:
            event.synchronize()
        return tensor.to("cpu").contiguous()
    return tensor.contiguous()
