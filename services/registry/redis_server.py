"""A local `redis-server` on loopback, for `pdserve up` without a Redis URL and for tests.

It is authenticated by default: a generated password (`requirepass`), given to
redis-server in a config file of mode 0600 in a private folder (never on the command
line, where `ps` would show it), and carried in the URL. redis-server reads that file
once, at start, so the folder is removed as soon as the server answers: a process killed
without cleaning up (SIGKILL) leaves no password on disk. With `tls=True` it serves TLS
only (`rediss://`), with a certificate from a CA made for it; that folder (clients need
its CA file) stays until `cleanup()`, or this process's exit.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from urllib.parse import quote

from services.server.channels import free_port


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by this user only (created 0600, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


class RedisServer:
    """redis-server as a child process: no persistence, loopback only, a password."""

    def __init__(self, port: int = 0, password: str | None = None, tls: bool = False) -> None:
        self.port = port or free_port()
        # "" = no password (only for a test that shows what a password refuses).
        self.password = secrets.token_urlsafe(24) if password is None else password
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = self._private_dir()
        self.ca_file = self.dir / "certs" / "public" / "ca.crt"

    def _private_dir(self) -> Path:
        """A new folder of mode 0700, removed at the latest when this process exits."""
        path = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        weakref.finalize(self, shutil.rmtree, path, True)
        return path

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
        if not self.dir.exists():  # removed after the last start: a new one
            self.dir = self._private_dir()
        lines = ["bind 127.0.0.1", "protected-mode yes", 'save ""', "appendonly no",
                 "daemonize no", "loglevel warning", f"dir {tempfile.gettempdir()}"]
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
        ready = self.wait_ready(timeout)
        if not self.tls:  # read once, at start: the password leaves the disk now
            shutil.rmtree(self.dir, ignore_errors=True)
        if ready:
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
