"""The descriptor of a local `pdserve up` stack, kept in a file (mode 0600) so that
`pdserve scale`, `pdserve down` and `pdserve top` on the same machine find the stack's
Redis (with its password), its cluster secret, the folder of its own certificates and
where its routers' metrics are.

The file is $PDSERVE_STATE_FILE, else up.json beside the models cache; `pdserve up`
writes it once its Redis is ready and removes it when it stops.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from services.engine.model import models_dir
from services.registry.redis_server import write_private

STATE_FILE_ENV = "PDSERVE_STATE_FILE"


@dataclass(frozen=True, slots=True)
class LocalStack:
    """Where a running local stack keeps its cluster state."""

    redis_url: str  # with the password
    cluster_secret: str = ""  # "" = records are not signed
    tls_dir: str = ""  # the stack's own certificates (`pdserve certs` layout); "" = none
    router_metrics: tuple[str, ...] = ()  # routers' Prometheus endpoints known at start


def state_path() -> Path:
    """$PDSERVE_STATE_FILE, else up.json beside the models cache."""
    return Path(os.environ.get(STATE_FILE_ENV) or models_dir().parent / "up.json")


def write_state(stack: LocalStack) -> Path:
    """Record the local stack (readable by its owner only); the file's path."""
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps(asdict(stack)))
    return path


def read_state() -> LocalStack | None:
    """The local stack's descriptor; None when there is no readable one."""
    try:
        state = json.loads(state_path().read_text())
        return LocalStack(redis_url=str(state["redis_url"]),
                          cluster_secret=str(state.get("cluster_secret", "")),
                          tls_dir=str(state.get("tls_dir", "")),
                          router_metrics=tuple(str(a) for a in state.get("router_metrics", ())))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_state() -> None:
    state_path().unlink(missing_ok=True)
