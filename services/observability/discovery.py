"""Where a stack's metrics are, for Prometheus: a file-based service discovery file
(`file_sd_configs`), written by `pdserve up` and kept current as workers start, stop,
restart, move or scale.

The workers' metrics ports are chosen at start (any free port), so a static scrape
config cannot name them; each worker publishes its address in its registry record,
and this file turns the records into Prometheus targets: one group per process, with
the labels `role` (prefill, decode, router), `worker_id` (the router's actor name for
a router), `model` and `host`. Prometheus re-reads the file when it changes; it is
replaced atomically (a temporary file in the same folder, then a rename), so a scrape
never reads half a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.registry.local_stack import state_path
from services.registry.records import WorkerRecord
from services.registry.registry import Registry
from services.server.channels import local_host
from services.server.settings import ServerSettings

log = logging.getLogger(__name__)

SD_FILE_NAME = "prometheus-targets.json"


@dataclass(frozen=True, slots=True)
class RouterTarget:
    """A router's metrics endpoint, known to the launcher (routers have no record)."""

    name: str  # the actor name, e.g. router-0
    address: str  # host:port
    model: str = ""

    @classmethod
    def of(cls, name: str, server: ServerSettings) -> RouterTarget | None:
        """The router configured by `server`, when its metrics port is a fixed one (a
        free port, -1, is chosen inside the actor and not known here)."""
        if server.metrics_port <= 0:
            return None
        host = local_host(server.metrics_host or server.host)
        return cls(name, f"{host}:{server.metrics_port}")


def sd_file_path(configured: str = "") -> Path:
    """`configured`, else prometheus-targets.json beside the local stack's state file."""
    return Path(configured).expanduser() if configured else state_path().parent / SD_FILE_NAME


def _labels(**labels: str) -> dict[str, str]:
    return {k: v for k, v in labels.items() if v}  # an empty label is no label


def target_groups(
    workers: Iterable[WorkerRecord], routers: Sequence[RouterTarget] = ()
) -> list[dict[str, object]]:
    """The `file_sd_configs` document: one group per process with a metrics endpoint,
    routers first, then workers by role and id (a stable order: an unchanged fleet
    gives an unchanged file)."""
    groups: list[dict[str, object]] = []
    records = sorted(workers, key=lambda w: (w.role != "prefill", w.worker_id))
    model = next((w.model for w in records if w.model), "")  # what the routers serve
    for r in routers:
        groups.append(
            {
                "targets": [r.address],
                "labels": _labels(role="router", worker_id=r.name, model=r.model or model),
            }
        )
    for w in records:
        if target := w.metrics_target:
            groups.append(
                {
                    "targets": [target],
                    "labels": _labels(
                        role=w.role, worker_id=w.worker_id, model=w.model, host=w.host
                    ),
                }
            )
    return groups


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one rename: readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # Prometheus may run as another user
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class TargetsFile:
    """Keeps `path` equal to the registry's live workers (plus the given routers),
    rewriting it only when the targets change; on `close` it lists no target, so
    Prometheus stops scraping a stack that is gone."""

    def __init__(
        self,
        path: Path,
        registry: Registry,
        routers: Sequence[RouterTarget] = (),
        interval_s: float = 1.0,
    ) -> None:
        self.path, self.registry, self.routers = path, registry, list(routers)
        self.interval_s = interval_s
        self._written: str | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def of_stack(cls, configured: str, registry: Registry, router: ServerSettings) -> TargetsFile:
        """The file of a `pdserve up` stack: at `configured` (else the default path),
        with its first router (configured by `router`) when its metrics port is fixed."""
        target = RouterTarget.of("router-0", router)
        return cls(sd_file_path(configured), registry, [target] if target else [])

    @property
    def router_addresses(self) -> tuple[str, ...]:
        return tuple(r.address for r in self.routers)

    def write(self, groups: list[dict[str, object]]) -> bool:
        """Write `groups` unless the file already holds them; whether it was written."""
        text = json.dumps(groups, indent=2) + "\n"
        if text == self._written:
            return False
        write_atomically(self.path, text)
        self._written = text
        return True

    async def refresh(self) -> None:
        """Read the registry once and write the file if the targets changed."""
        self.write(target_groups(await self.registry.workers(), self.routers))

    async def _keep(self) -> None:
        failing = False  # logged once per outage, not every interval
        while True:
            try:
                await self.refresh()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis restarting, a full disk: keep the last file
                if not failing:
                    log.warning(
                        "could not update the Prometheus targets in %s (retrying; "
                        "--prometheus-sd-file chooses another path): %s: %s",
                        self.path,
                        type(e).__name__,
                        e,
                    )
                failing = True
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Follow the registry from now on, every interval (the routers at once)."""
        self._task = asyncio.create_task(self._keep())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(OSError):
            self.write([])
