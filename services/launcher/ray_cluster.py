"""Ray for `pdserve up`: join the given cluster, or start a local one.

A local cluster uses a loopback node address, no dashboard (its jobs API runs code) and
Ray's token authentication (on by default in this Ray). Ray still binds its GCS, raylet,
object manager and every worker's core-worker port on all interfaces (they take no bind
address); those are Ray's, token-authenticated.
"""

from __future__ import annotations

import logging

from services.launcher.actor_spec import NAMESPACE, ROLES
from services.launcher.settings import LOOPBACK, LauncherConfig
from services.observability.logs import level_of, quiet

# Per-role custom resources of a local cluster: every role fits on this machine. A real
# cluster gives them to the node types that should host each role (deploy/ray-cluster.yaml).
LOCAL_RESOURCES = {f"pdserve_{role}": 64 for role in (*ROLES, "router")}


def start_ray(launcher: LauncherConfig, log_level: str = "INFO") -> None:
    """Connect this process to Ray: `--ray-address`, else a new local cluster. Ray's own
    notices print at `--log-level debug` only (its errors always); the actors' output is
    forwarded here."""
    import ray

    level = level_of(log_level)
    ray_level = logging.ERROR if quiet(level) else level
    if launcher.ray_address:
        ray.init(address=launcher.ray_address, namespace=NAMESPACE, logging_level=ray_level)
        return
    ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=True,
             object_store_memory=256 << 20, _node_ip_address=LOOPBACK,
             resources=LOCAL_RESOURCES, logging_level=ray_level)
