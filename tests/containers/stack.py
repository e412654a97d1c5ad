"""A pdserve stack of containers from one image, on the host's network: Redis (the
image's redis-server), a prefill worker, a decode worker and a router, each in its own
container, with the security defaults of a deployment: a Redis password, the cluster
secret, an API key on the router and internal mTLS (each container mounts only its own
role's certificate and key, read-only)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from services.server.channels import free_port
from tests.containers.engine import Engine, unique, wait_until

MODEL = "/models/SmolLM2-135M-Instruct-float32"  # baked in by deploy/Dockerfile.cpu
IMAGE_UID = 10001  # the image's user (deploy/Dockerfile.cpu)
ROLES = ("prefill", "decode", "router")
# As deploy/compose.yaml runs pdserve's containers.
HARDENING = ["--read-only", "--tmpfs", "/tmp", "--tmpfs", "/home/pdserve/.cache",
             "--shm-size", "1g", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]


def readable_by_image(path: Path) -> None:
    """Let the image's user read `path` (a file or folder) without opening it to others:
    chown to its uid as root (what a Kubernetes fsGroup does); otherwise, as a user whose
    engine maps uids, leave modes to the engine's own chown and fall back to group/other
    read (pdserve then warns of a readable key)."""
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    if os.geteuid() == 0:
        for p in paths:
            os.chown(p, IMAGE_UID, IMAGE_UID)
        return
    for p in paths:
        p.chmod(0o755 if p.is_dir() else 0o644)


def make_role_certs(directory: Path) -> dict[str, Path]:
    """`pdserve certs init`, then one folder per role with the internal CA certificate and
    that role's certificate and key (never the CA's key)."""
    full = directory / "certs"
    subprocess.run([sys.executable, "-m", "services.cli", "certs", "init", str(full)],
                   check=True, capture_output=True, timeout=120)
    out = {}
    for role in ROLES:
        mount = directory / f"certs-{role}"
        mount.mkdir(mode=0o700)
        for name in ("ca.crt", f"{role}.crt", f"{role}.key"):
            shutil.copy2(full / "internal" / name, mount / name)
        readable_by_image(mount)
        out[role] = mount
    return out


def write_env_file(path: Path, env: dict[str, str]) -> Path:
    """Secrets reach the containers through an env file (0600), not the engine's command
    line, which `ps` shows."""
    path.touch(mode=0o600)
    path.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return path


@dataclass
class ContainerStack:
    engine: Engine
    image: str
    directory: Path
    redis_password: str = field(default_factory=lambda: secrets.token_hex(24))
    cluster_secret: str = field(default_factory=lambda: secrets.token_hex(32))
    api_key: str = field(default_factory=lambda: "pdsk_" + secrets.token_urlsafe(32))
    redis_port: int = field(default_factory=free_port)
    ports: dict[str, int] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.ports['router']}"

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.redis_password}@127.0.0.1:{self.redis_port}/0"

    def start_redis(self) -> None:
        """redis-server from the pdserve image; the password goes in on stdin as
        configuration, never on a command line."""
        name = unique("pdserve-test-redis")
        env = write_env_file(self.directory / "redis.env",
                             {"REDIS_PASSWORD": self.redis_password})
        script = ('printf "requirepass %s\\n" "$REDIS_PASSWORD" | redis-server - '
                  f'--bind 127.0.0.1 --port {self.redis_port} --save "" --appendonly no '
                  '--protected-mode yes')
        self.names["redis"] = self.engine.run_detached(
            name, [*HARDENING, "--env-file", str(env), "--entrypoint", "sh"], self.image,
            ["-c", script])

        def answers() -> bool:
            import redis

            self.check_running("redis")
            try:
                return bool(redis.Redis.from_url(self.redis_url, socket_timeout=2).ping())
            except redis.RedisError:
                return False

        wait_until(answers, 120, "redis-server in its container")

    def start_pdserve(self, certs: dict[str, Path], cores: dict[str, str]) -> None:
        """The two workers, then the router (it opens its port once a decode worker has
        registered)."""
        for role in ROLES:
            self.ports[role] = free_port()
            self.ports[f"{role}-metrics"] = free_port()
        self.ports["kv"] = free_port()
        self.ports["http"] = free_port()
        common = {
            "PDSERVE_REDIS_URL": self.redis_url,
            "PDSERVE_CLUSTER_SECRET": self.cluster_secret,
            "PDSERVE_HOST": "127.0.0.1",
            "PDSERVE_GRACE_S": "5",
            "PDSERVE_INTERNAL_TLS_CA_FILE": "/certs/ca.crt",
        }
        for role in ROLES:
            env = {**common, "PDSERVE_PORT": str(self.ports[role]),
                   "PDSERVE_METRICS_PORT": str(self.ports[f"{role}-metrics"]),
                   "PDSERVE_INTERNAL_TLS_CERT_FILE": f"/certs/{role}.crt",
                   "PDSERVE_INTERNAL_TLS_KEY_FILE": f"/certs/{role}.key"}
            if role == "router":
                env |= {"PDSERVE_ROUTER_MODEL": MODEL, "PDSERVE_HTTP_PORT": str(self.ports["http"]),
                        "PDSERVE_API_KEYS": f"tests:{self.api_key}"}
            else:
                env |= {"PDSERVE_MODEL": MODEL, "PDSERVE_KV_CACHE_GIB": "1"}
                if cores.get(role):
                    env["PDSERVE_CPU_CORES"] = cores[role]
            if role == "decode":
                env |= {"PDSERVE_KV_PORT": str(self.ports["kv"]), "PDSERVE_KV_TRANSPORT": "grpc"}
            env_file = write_env_file(self.directory / f"{role}.env", env)
            options = [*HARDENING, "--env-file", str(env_file),
                       "-v", f"{certs[role]}:/certs:ro"]
            self.names[role] = self.engine.run_detached(
                unique(f"pdserve-test-{role}"), options, self.image, [role])

    def check_running(self, role: str) -> None:
        if not self.engine.running(self.names[role]):
            raise RuntimeError(f"the {role} container stopped:\n"
                               f"{self.engine.logs(self.names[role])}")

    def save_logs(self) -> None:
        for role, name in self.names.items():
            (self.directory / f"{role}.log").write_text(self.engine.logs(name, tail=400))

    def stop(self) -> None:
        self.save_logs()
        self.engine.remove(*self.names.values())
