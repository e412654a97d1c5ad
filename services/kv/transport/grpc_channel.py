"""gRPC plumbing of the KV transports: the service's method names, channel and server
options, and error text. Every KV channel and server is made through this module."""

from __future__ import annotations

from typing import Any

import grpc
import torch

from services.kv.transport.spec import TransportConfig

SERVICE = "pdserve.v1.KVTransfer"
PUSH = f"/{SERVICE}/Push"  # client stream of frames -> one ACK (gRPC transport)
PAIR = f"/{SERVICE}/Pair"  # bidirectional control stream of a torch pair group
SHM = f"/{SERVICE}/Shm"  # bidirectional control stream of a same-host transfer


def channel_options(config: TransportConfig) -> list[tuple[str, Any]]:
    """Client options: explicit message limits (the default receive limit is 4 MiB) and
    keepalive pings so a peer that vanished without closing its socket is noticed."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(config: TransportConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),  # two receivers must never share a port silently
    ]


# Every internal certificate carries this DNS name (services/security/certs.py): peers are
# reached by addresses that change, so the name, not the address, is what is checked.
INTERNAL_NAME = "pdserve.internal"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def open_channel(peer: str, config: TransportConfig) -> grpc.Channel:
    """A blocking channel to a KV receiver: mutual TLS when the config has the files."""
    if not config.tls:
        return grpc.insecure_channel(peer, options=channel_options(config))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca_file),
        private_key=_read(config.tls_key_file),
        certificate_chain=_read(config.tls_cert_file))
    options = [*channel_options(config), ("grpc.ssl_target_name_override", INTERNAL_NAME)]
    return grpc.secure_channel(peer, credentials, options=options)


def bind(server: grpc.Server, host: str, port: int, config: TransportConfig) -> str:
    """Bind `server` to host:port; returns the "host:port" actually bound. With the TLS
    files, the port requires a client certificate from the internal CA: the torch
    transport's rendezvous and a peer's HELLO travel only over such an authenticated
    stream, so an unauthenticated peer never learns the store address."""
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    if config.tls:
        credentials = grpc.ssl_server_credentials(
            [(_read(config.tls_key_file), _read(config.tls_cert_file))],
            root_certificates=_read(config.tls_ca_file), require_client_auth=True)
        bound = server.add_secure_port(f"{bracketed}:{port}", credentials)
    else:
        bound = server.add_insecure_port(f"{bracketed}:{port}")
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
