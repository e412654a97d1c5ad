"""The container engine the container tests run pdserve's image with: docker (its daemon
answering) or podman, whichever is usable here, probed by really starting the image.

`CONTAINER_ENGINE` (docker or podman) picks one; `PDSERVE_IMAGE` names the image
(default localhost/pdserve:cpu, what `make images` builds).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

IMAGE = os.environ.get("PDSERVE_IMAGE", "localhost/pdserve:cpu")
BUILD_HINT = "build it with `make images`"
# Where rootful podman runs inside another container (as on some CI machines), setting
# the default rlimits of a new container is refused ("setrlimit ... Operation not
# permitted"); the container then keeps the limits it inherits. Protection is unchanged:
# rlimits are a resource bound, not an isolation boundary.
NO_DEFAULT_ULIMITS = "[containers]\ndefault_ulimits = []\n"


class EngineUnusable(Exception):
    """No container engine here can run the image: the message says why and what to do."""


@dataclass
class Engine:
    """`argv` runs the engine (e.g. ["podman", "--runtime", "runc"]); `env` is the
    environment its commands need."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    name: str = ""

    def cmd(self, *args: str, check: bool = True, timeout: float = 600,
            **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.argv, *args], env={**os.environ, **self.env},
                              capture_output=True, text=True, check=check,
                              timeout=timeout, **kwargs)  # type: ignore[call-overload]

    def run_detached(self, name: str, options: Sequence[str], image: str,
                     command: Sequence[str] = ()) -> str:
        """Start a container in the background (host network); its name."""
        out = self.cmd("run", "-d", "--name", name, "--network", "host", *options, image,
                       *command, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{self.name} run {name} failed: {out.stderr.strip()}")
        return name

    def running(self, name: str) -> bool:
        out = self.cmd("inspect", "--format", "{{.State.Running}}", name, check=False)
        return out.stdout.strip() == "true"

    def logs(self, name: str, tail: int = 60) -> str:
        out = self.cmd("logs", "--tail", str(tail), name, check=False)
        return (out.stdout + out.stderr).strip()

    def remove(self, *names: str) -> None:
        for name in names:
            self.cmd("rm", "-f", "-t", "20", name, check=False, timeout=120)


def _image_present(argv: list[str], env: dict[str, str], image: str) -> bool:
    out = subprocess.run([*argv, "image", "inspect", image], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    return out.returncode == 0


def _starts(argv: list[str], env: dict[str, str], image: str) -> tuple[bool, str]:
    out = subprocess.run([*argv, "run", "--rm", "--network", "host", "--entrypoint",
                          "python", image, "-c", "import services.cli"],
                         env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300)
    return out.returncode == 0, (out.stderr or out.stdout).strip()[-600:]


def _usable(name: str) -> bool:
    if shutil.which(name) is None:
        return False
    return subprocess.run([name, "info"], capture_output=True, timeout=120).returncode == 0


def detect(image: str = IMAGE) -> Engine:
    """The first engine that starts `image`, or EngineUnusable saying why none does."""
    wanted = os.environ.get("CONTAINER_ENGINE", "")
    names = [wanted] if wanted else ["docker", "podman"]
    why: list[str] = []
    for name in names:
        if not _usable(name):
            why.append(f"{name}: not installed, or `{name} info` fails")
            continue
        candidates: list[tuple[list[str], dict[str, str], str]] = [([name], {}, "")]
        if name == "podman":
            conf = Path(tempfile.mkdtemp(prefix="pdserve-containers-conf-")) / "containers.conf"
            conf.write_text(NO_DEFAULT_ULIMITS)
            fix = {"CONTAINERS_CONF": str(conf)}
            candidates.append(([name], fix, "default_ulimits = []"))
            if shutil.which("runc"):
                candidates.append(([name, "--runtime", "runc"], fix,
                                   "default_ulimits = [] and the runc runtime"))
        if not _image_present([name], candidates[-1][1], image):
            why.append(f"{name}: the image {image} is not there: {BUILD_HINT}")
            continue
        for argv, env, change in candidates:
            ok, error = _starts(argv, env, image)
            if ok:
                if change:
                    log.warning("%s starts containers here only with %s (%s)", name, change,
                                "this machine refuses setrlimit in new containers")
                return Engine(argv, env, name)
            why.append(f"{' '.join(argv)}{' with ' + change if change else ''}: {error}")
    raise EngineUnusable("no usable container engine runs " + image + ": " + "; ".join(why)
                         + " (install docker or podman; Debian: apt-get install podman runc)")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_until(predicate, timeout: float, what: str, interval: float = 1.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)
