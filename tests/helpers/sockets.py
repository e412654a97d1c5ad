"""The listening TCP sockets of a process tree (psutil), for tests of default binds."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str  # the process's name (Ray and vLLM set titles: ray::ServiceActor, ...)
    cmdline: str
    ip: str
    port: int

    @property
    def loopback(self) -> bool:
        address = ipaddress.ip_address(self.ip.split("%")[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1 is loopback (not to 3.11)
        return address.is_loopback

    def __str__(self) -> str:
        return f"{self.ip}:{self.port} ({self.process}, pid {self.pid})"


def tree(root_pid: int) -> list[psutil.Process]:
    root = psutil.Process(root_pid)
    return [root, *root.children(recursive=True)]


def listeners(root_pid: int) -> list[Listener]:
    """Every TCP socket in LISTEN state held by `root_pid` or its descendants."""
    out: list[Listener] = []
    for proc in tree(root_pid):
        try:
            name, cmdline = proc.name(), " ".join(proc.cmdline())
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += [Listener(proc.pid, name, cmdline, c.laddr.ip, c.laddr.port) for c in conns
                if c.status == psutil.CONN_LISTEN]
    return out


def pid_listening_on(root_pid: int, port: int) -> int:
    (pid,) = {s.pid for s in listeners(root_pid) if s.port == port}
    return pid
