"""How a pdserve process opens gRPC channels to its peers (workers, routers, KV
receivers) and the options every server and channel shares: message limits,
keepalives, reconnect backoff. TLS material is passed in, never read from process
state: the object that dials carries the files it dials with. Loopback helpers too."""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

import grpc

from services.security.tls import (
    INTERNAL_CHANNEL_OPTIONS,
    TLSFiles,
    internal_channel_credentials,
)

MAX_MESSAGE_BYTES = 64 << 20  # default largest gRPC message accepted or sent

Options = list[tuple[str, Any]]


def message_limits(max_message_bytes: int = MAX_MESSAGE_BYTES) -> Options:
    """The largest message sent and received (gRPC's default receive limit is 4 MiB)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> Options:
    """The options of pdserve's API servers and of the channels to them."""
    return [
        *message_limits(max_message_bytes),
        # Long streams stay open for minutes: keepalives find dead peers, and the
        # server lets clients ping during idle streams.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Channels to workers reconnect within seconds after a worker restarts.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def dial(address: str, tls: TLSFiles | None,
         max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """An asyncio channel to a pdserve peer (a worker, a router): mTLS with `tls`,
    checking the peer's certificate for `pdserve.internal`; plaintext when `tls` is None."""
    opts = grpc_options(max_message_bytes)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, internal_channel_credentials(tls),
                                   options=[*opts, *INTERNAL_CHANNEL_OPTIONS])


def dial_blocking(address: str, tls: TLSFiles | None, options: Options) -> grpc.Channel:
    """As `dial`, for the threads that block on their calls (the KV transports)."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, internal_channel_credentials(tls),
                               options=[*options, *INTERNAL_CHANNEL_OPTIONS])


_HANDED_OUT: set[int] = set()  # ports free_port gave this process, never given twice


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (for tests and local child processes that take a port
    number; servers of our own bind port 0 and report what they got instead).

    Chosen below the kernel's ephemeral range: a port that bind(0) returns is an
    ephemeral one, which the kernel may give to another socket (an engine's, a client's
    connection) before the child process binds it, often tens of seconds later."""
    low = _ephemeral_low()
    for _ in range(256):
        port = random.randrange(max(1024, low - 12288), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # that range is full: an ephemeral port, as before
        s.bind((host, 0))
        return int(s.getsockname()[1])


def local_host(bind_host: str) -> str:
    """The address peers on this machine use for a server bound to `bind_host`."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "127.0.0.1", "") else bind_host
