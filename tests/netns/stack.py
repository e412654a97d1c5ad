"""pdserve as it runs on separate machines, started in a `Fabric`'s hosts: redis-server,
prefill and decode workers and a router, each bound to its own host's address (never
0.0.0.0, never loopback), with the cluster's credentials as a multi-host deployment has
them: a Redis password, a cluster secret for the records, internal mTLS between router,
workers and KV transports, and on the public API an API key and a TLS certificate issued
for the router's address.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from prometheus_client.parser import text_string_to_metric_families

from services.api.client import PdserveClient
from services.registry.redis_server import write_private
from services.security import certs
from services.security.tls import TLSFiles
from services.server.channels import dial
from tests.helpers.servers import scrape
from tests.netns.harness import Fabric, stop_group

GRPC_PORT = 50051  # every host has its own ports: one number for all of them
METRICS_PORT = 9400
KV_PORT = 7100
REDIS_PORT = 6379
API_KEY = "netns-tester-0123456789abcdef"


@dataclass
class Service:
    host: str
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.host} exited ({self.proc.returncode}):\n"
                               f"{self.log_tail()}")


@dataclass
class NetStack:
    fabric: Fabric
    workdir: Path
    certs_dir: Path = field(init=False)
    redis_password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    cluster_secret: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    services: dict[str, Service] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.certs_dir = self.workdir / "certs"
        # The public server certificate names the router's address, which clients dial.
        certs.init(self.certs_dir, hosts=(self.fabric.addr("router"),))
        self.keys_file = self.workdir / "api-keys"
        write_private(self.keys_file, f"tester:{API_KEY}\n")

    # -- addresses and credentials ------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return (f"redis://:{quote(self.redis_password, safe='')}@"
                f"{self.fabric.addr('redis')}:{REDIS_PORT}/0")

    def target(self, host: str) -> str:
        return f"{self.fabric.addr(host)}:{GRPC_PORT}"

    def internal_tls_flags(self, role: str) -> list[str]:
        files = certs.internal_files(self.certs_dir, role)
        return ["--internal-tls-ca-file", str(files.ca), "--internal-tls-cert-file",
                str(files.cert), "--internal-tls-key-file", str(files.key)]

    def client(self) -> PdserveClient:
        """A public API client of the router, from the machine running the tests."""
        return PdserveClient(self.target("router"), api_key=API_KEY,
                             tls=TLSFiles(ca=certs.public_files(self.certs_dir, "server").ca))

    def metrics(self, host: str, **labels: str) -> dict[str, float]:
        """`host`'s Prometheus samples by name (labels dropped; with `labels`, only
        samples carrying them; first sample wins)."""
        return scrape(METRICS_PORT, self.fabric.addr(host), **labels)

    def labelled(self, host: str, name: str, label: str) -> dict[str, float]:
        """The samples of metric `name` on `host`, by the value of `label`."""
        url = f"http://{self.fabric.addr(host)}:{METRICS_PORT}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {s.labels.get(label, ""): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == name}

    # -- starting -----------------------------------------------------------------------
    def start_redis(self) -> None:
        """redis-server bound to the redis host's address, with a password; its config
        file (which holds the password) is removed once the server has read it."""
        folder = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        conf = folder / "redis.conf"
        write_private(conf, "\n".join([
            f"bind {self.fabric.addr('redis')}", "protected-mode yes", f"port {REDIS_PORT}",
            'save ""', "appendonly no", "daemonize no", "loglevel warning",
            f"dir {tempfile.gettempdir()}", f"requirepass {self.redis_password}"]) + "\n")
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; on Debian: "
                               "apt-get install redis-server")
        log = self.workdir / "redis.log"
        self.services["redis"] = Service("redis", self.fabric.popen(
            "redis", [binary, str(conf)], log), log)
        try:
            self._wait_redis()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _wait_redis(self, timeout: float = 15.0) -> None:
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_timeout=0.5,
                                      socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                self.services["redis"].check_alive()
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server did not answer:\n"
                                       f"{self.services['redis'].log_tail()}")
                time.sleep(0.1)
        finally:
            client.close()

    def _start(self, host: str, command: str, args: list[str]) -> Service:
        addr = self.fabric.addr(host)
        cmd = [sys.executable, "-m", "services.cli", command, "--host", addr,
               "--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT),
               "--redis-url", self.redis_url, *args]
        log = self.workdir / f"{host}.log"
        service = Service(host, self.fabric.popen(
            host, cmd, log, env={"PDSERVE_CLUSTER_SECRET": self.cluster_secret}), log)
        self.services[host] = service
        return service

    def start_worker(self, host: str, role: str, cores: str, *extra: str) -> Service:
        args = ["--worker-id", host, "--cpu-cores", cores, "--kv-cache-gib", "1",
                "--worker-ttl-s", "3", *self.internal_tls_flags(role), *extra]
        if role == "decode":
            args += ["--kv-host", self.fabric.addr(host), "--kv-port", str(KV_PORT)]
        return self._start(host, role, args)

    def start_router(self, *extra: str) -> Service:
        server = certs.public_files(self.certs_dir, "server")
        return self._start("router", "router", [
            "--api-keys-file", str(self.keys_file), "--tls-cert-file", str(server.cert),
            "--tls-key-file", str(server.key), *self.internal_tls_flags("router"), *extra])

    async def wait_ready(self, hosts: list[str], timeout: float = 900.0) -> None:
        """Every host's gRPC health SERVING: workers over internal mTLS (as the router
        reaches them), the router over its public TLS."""
        internal = certs.internal_files(self.certs_dir, "router")

        async def one(host: str) -> None:
            deadline = time.monotonic() + timeout
            client = (self.client() if host == "router" else
                      PdserveClient(channel=dial(self.target(host), internal)))
            async with client:
                while True:
                    self.services[host].check_alive()
                    try:
                        if await client.health(timeout=2.0) == "SERVING":
                            return
                    except Exception:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{host} not ready:\n"
                                           f"{self.services[host].log_tail()}")
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(one(h) for h in hosts))

    def stop(self, host: str) -> None:
        service = self.services.pop(host, None)
        if service is not None:
            stop_group(service.proc)

    def close(self) -> None:
        # The router first (it stops sending), Redis last (the workers deregister there).
        order = sorted(self.services, key=lambda h: (h != "router", h == "redis"))
        for host in order:
            self.stop(host)
