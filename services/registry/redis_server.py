"""A local `redis-server` on loopback, for `pdserve up` without a Redis URL and for tests.

It is authenticated by default: a generated password (`requirepass`), given to
redis-server in a config file of mode 0600 in a private folder (never on the command
line, where `ps` would show it), and carried in the URL. With `tls=True` it serves TLS
only (`rediss://`), with a certificate from a CA made for it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from services.server.channels import free_port


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by this user only (created 0600, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def redact(url: str) -> str:
    """`url` with its password replaced, for logs and banners."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisServer:
    """redis-server as a child process: no persistence, loopback only, a password."""

    def __init__(self, port: int = 0, password: str | None = None, tls: bool = False) -> None:
        self.port = port or free_port()
        # "" = no password (only for a test that shows what a password refuses).
        self.password = secrets.token_urlsafe(24) if password is None else password
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))  # mode 0700
        self.ca_file = self.dir / "certs" / "public" / "ca.crt"

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        query = f"?ssl_ca_certs={quote(str(self.ca_file))}" if self.tls else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0{query}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _config(self) -> Path:
        lines = ["bind 127.0.0.1", "protected-mode yes", 'save ""', "appendonly no",
                 "daemonize no", "loglevel warning", f"dir {self.dir}"]
        if self.password:
            lines.append(f"requirepass {self.password}")
        if self.tls:
            from services.security.certs import init

            public = init(self.dir / "certs", hosts=("127.0.0.1",)).directory / "public"
            self.ca_file = public / "ca.crt"
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {public}/server.crt",
                      f"tls-key-file {public}/server.key", f"tls-ca-cert-file {self.ca_file}",
                      "tls-auth-clients no"]
        else:
            lines.append(f"port {self.port}")
        path = self.dir / "redis.conf"
        write_private(path, "\n".join(lines) + "\n")
        return path

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start (or, after it died, restart on the same port with the same password)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; on Debian/Ubuntu: "
                               "apt-get install redis-server (or pass --redis-url)")
        self.proc = subprocess.Popen([binary, str(self._config())],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.wait_ready(timeout):
            return self
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def wait_ready(self, timeout: float) -> bool:
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and self.alive:
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        """Stop and remove the config folder (its password and keys)."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
