"""Ray for `pdserve up`: join the given cluster, or start a local one.

A local cluster is a single-node one on a loopback node address (see `start_ray`), with no
dashboard (its jobs API runs code) and Ray's token authentication (on by default in this
Ray). Its GCS, raylet, object manager, agents, autoscaler monitor and every worker's
core-worker port then listen on loopback; a cluster joined with `--ray-address` binds as
that cluster was started.
"""

from __future__ import annotations

import logging
import os

from services.launcher.actor_spec import NAMESPACE, ROLES
from services.launcher.settings import LOOPBACK, LauncherConfig
from services.observability.logs import level_of, quiet

# "0": a local cluster of one node, on loopback (see `start_ray`).
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
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
    # Ray turns a loopback node address into the machine's own (a cluster node must be
    # reachable from others), and then serves on every interface: its GCS, raylet and
    # workers' ports, its autoscaler monitor's metrics. Its single-node mode (the default
    # on macOS and Windows) keeps the node, and them, on loopback. The variable is read
    # when `ray` is imported, which already happened here, and by each process Ray starts.
    os.environ[SINGLE_NODE_ENV] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=True,
             object_store_memory=256 << 20, _node_ip_address=LOOPBACK,
             resources=LOCAL_RESOURCES, logging_level=ray_level)
