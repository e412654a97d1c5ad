"""The Helm chart, rendered by the real Helm engine (as tests/integration/test_helm_chart.py
renders it), played with `podman kube play` on the built image: the router, prefill and
decode pods start from the chart's own commands, env, ConfigMaps, Secrets and probes, find
each other through the chart's Redis, and serve a request with the chart's API key.

podman kube play is not a cluster. What it lacks, the test stands in for, and nothing
else (every change is in `kubelet_stand_in`):

- kinds it ignores or does not run: Services, NetworkPolicies, PodDisruptionBudgets and
  the ServiceAccount are dropped; the Redis StatefulSet runs as a Deployment of the same
  pod template;
- the pods share the host's network (as `podman kube play --network host`), so each role
  gets its own ports through the chart's values, status.podIP is 127.0.0.1, and the Redis
  Service's name resolves to 127.0.0.1 (the URL's host is rewritten); podman refuses a
  container's `ports` on the host's network (it would map them), so they are dropped,
  probes that name a port given its number first;
- podman makes each emptyDir a named volume shared by every pod with a volume of that
  name, owned by root: each becomes a world-writable folder of the pod's own, as the
  kubelet makes it;
- podman 4.x mounts neither projected volumes nor expands `$(VAR)` references in env,
  command and args: the test writes each projected Secret volume into a folder (mode and
  group as the kubelet would: defaultMode, fsGroup) mounted as a hostPath, and gives env,
  command and args their values (secretKeyRef and `$(VAR)` resolved from the rendered
  Secrets);
- podman runs no gRPC probes: the test asks each pod's startup/readiness probe (the
  chart's own port and service) until it answers SERVING.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import os
import re
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import grpc
import pytest
import yaml

from services.api.client import PdserveClient
from services.server.channels import free_port
from tests.containers.conftest import unavailable
from tests.containers.engine import IMAGE, Engine
from tests.containers.stack import IMAGE_UID

pytestmark = [pytest.mark.container, pytest.mark.engine]

IGNORED_KINDS = {"Service", "NetworkPolicy", "PodDisruptionBudget", "ServiceAccount"}
START_TIMEOUT_S = 900


def chart_values() -> dict[str, Any]:
    """One pod per role (they share the host's ports), each role on its own ports."""
    repository, _, tag = IMAGE.rpartition(":")
    ports = {role: {"grpc": free_port(), "metrics": free_port(), "health": free_port()}
             for role in ("router", "prefill", "decode")}
    ports["router"]["http"] = free_port()
    ports["decode"]["kv"] = free_port()
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "router": {"replicas": 1, "ports": ports["router"]},
        "prefill": {"ports": ports["prefill"]},
        "decode": {"ports": ports["decode"]},
        "redis": {"image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
                  "port": free_port()},
    }


def secret_data(objects: list[dict[str, Any]]) -> dict[str, dict[str, bytes]]:
    out = {}
    for o in objects:
        if o["kind"] == "Secret":
            data = {k: base64.b64decode(v) for k, v in (o.get("data") or {}).items()}
            data |= {k: v.encode() for k, v in (o.get("stringData") or {}).items()}
            out[o["metadata"]["name"]] = data
    return out


def _env(container: dict[str, Any], secrets: dict[str, dict[str, bytes]],
         config_maps: dict[str, dict[str, str]], redis_port: int) -> list[dict[str, str]]:
    """The container's env with values, as the kubelet gives it: secretKeyRef read,
    status.podIP the host's loopback, `$(VAR)` expanded; the Redis Service's name -> the
    host's loopback."""
    known: dict[str, str] = {}
    for source in container.get("envFrom", []):
        known |= config_maps.get(source.get("configMapRef", {}).get("name", ""), {})
    env = []
    for var in container.get("env", []):
        if "value" in var:
            value = re.sub(r"\$\((\w+)\)", lambda m: known.get(m[1], m[0]), str(var["value"]))
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            value = secrets[ref["name"]][ref["key"]].decode()
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            value = "127.0.0.1"
        else:
            raise AssertionError(f"env {var['name']}: no stand-in for {var['valueFrom']}")
        if var["name"] == "PDSERVE_REDIS_URL":
            url = urlsplit(value)
            auth = url.netloc.rpartition("@")[0]
            value = urlunsplit(url._replace(
                netloc=f"{auth}@127.0.0.1:{redis_port}" if auth else f"127.0.0.1:{redis_port}"))
        known[var["name"]] = value
        env.append({"name": var["name"], "value": value})
    return env


def _write_projected(volume: dict[str, Any], secrets: dict[str, dict[str, bytes]],
                     folder: Path, fs_group: int | None) -> None:
    spec = volume.get("projected") or {"sources": [{"secret": volume["secret"]}],
                                       "defaultMode": volume["secret"].get("defaultMode")}
    mode = spec.get("defaultMode") or 0o644
    for source in spec["sources"]:
        if "secret" not in source:
            raise AssertionError(f"volume {volume['name']}: no stand-in for {source}")
        ref = source["secret"]
        name = ref.get("name") or ref.get("secretName")
        items = ref.get("items") or [{"key": k, "path": k} for k in secrets[name]]
        for item in items:
            path = folder / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(secrets[name][item["key"]])
            path.chmod(item.get("mode") or mode)
    for p in [folder, *folder.rglob("*")]:
        if p.is_dir():
            p.chmod(0o755)
        if os.geteuid() == 0:
            os.chown(p, 0, fs_group if fs_group is not None else 0)


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _expand_arguments(container: dict[str, Any]) -> None:
    """`$(VAR)` in command and args from the container's env, as the kubelet expands
    them (podman 4.x passes them on as they are)."""
    env = {var["name"]: var["value"] for var in container["env"]}
    for key in ("command", "args"):
        if key in container:
            container[key] = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), str(a))
                              for a in container[key]]


def _host_network_ports(container: dict[str, Any]) -> None:
    """On the host's network a container's ports are the process's own: drop `ports`,
    giving probes that name one its number."""
    numbers = {p["name"]: p["containerPort"] for p in container.pop("ports", []) if "name" in p}
    for probe in (container.get(k) for k in PROBES):
        for action in ("tcpSocket", "grpc", "httpGet"):
            target = (probe or {}).get(action)
            if target is not None and isinstance(target.get("port"), str):
                target["port"] = numbers[target["port"]]


def kubelet_stand_in(objects: list[dict[str, Any]], folder: Path,
                     redis_port: int) -> tuple[list[dict[str, Any]], list[tuple[str, dict]]]:
    """What podman kube play can run, and (pod name, container) of each workload's
    container for the probes; see the module's docstring."""
    secrets = secret_data(objects)
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects
                   if o["kind"] == "ConfigMap"}
    played: list[dict[str, Any]] = []
    containers: list[tuple[str, dict]] = []
    for original in objects:
        o = copy.deepcopy(original)
        if o["kind"] in IGNORED_KINDS or o["kind"] == "Secret":
            continue
        if o["kind"] == "StatefulSet":
            o["kind"] = "Deployment"
            for key in ("serviceName", "volumeClaimTemplates", "podManagementPolicy"):
                o["spec"].pop(key, None)
        if o["kind"] == "Deployment":
            name = o["metadata"]["name"]
            spec = o["spec"]["template"]["spec"]
            fs_group = spec.get("securityContext", {}).get("fsGroup")
            for volume in spec.get("volumes", []):
                if "emptyDir" in volume:
                    # podman turns an emptyDir into a named volume shared by every pod
                    # with a volume of that name, owned by root 0755; the kubelet gives
                    # each pod a world-writable folder of its own.
                    volume.pop("emptyDir")
                    path = folder / name / f"empty-{volume['name']}"
                    path.mkdir(parents=True)
                    path.chmod(0o1777)
                    volume["hostPath"] = {"path": str(path), "type": "Directory"}
                if "projected" in volume or "secret" in volume:
                    path = folder / name / volume["name"]
                    path.mkdir(parents=True)
                    _write_projected(volume, secrets, path, fs_group)
                    for key in ("projected", "secret"):
                        volume.pop(key, None)
                    volume["hostPath"] = {"path": str(path), "type": "Directory"}
            for container in spec["containers"]:
                container["env"] = _env(container, secrets, config_maps, redis_port)
                _expand_arguments(container)
                _host_network_ports(container)
                containers.append((name, container))
        played.append(o)
    return played, containers


async def probe_serving(port: int, service: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@dataclass
class Played:
    engine: Engine
    manifest: Path
    values: dict[str, Any]
    api_key: str
    containers: list[tuple[str, dict]]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.values['router']['ports']['grpc']}"

    def logs(self) -> str:
        names = self.engine.cmd("ps", "-a", "--format", "{{.Names}}", check=False).stdout.split()
        return "\n".join(f"== {n}\n{self.engine.logs(n, tail=40)}" for n in names
                         if n.startswith("demo-pdserve"))


async def wait_probes(played: Played, timeout: float) -> None:
    """The kubelet's part: every container's startup and readiness probes pass."""
    deadline = time.monotonic() + timeout
    pending = {(pod, c["name"]): c for pod, c in played.containers if "readinessProbe" in c}
    while pending:
        for key, container in list(pending.items()):
            probe = container["readinessProbe"]
            if "grpc" in probe and await probe_serving(probe["grpc"]["port"],
                                                       probe["grpc"].get("service", "")):
                del pending[key]
            elif "exec" in probe:
                pod = key[0]
                name = f"{pod}-pod-0-{key[1]}"
                if played.engine.cmd("exec", name, *probe["exec"]["command"],
                                     check=False).returncode == 0:
                    del pending[key]
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready within {timeout:.0f} s: {sorted(pending)}\n"
                               f"{played.logs()}")
        await asyncio.sleep(3)


@pytest.fixture(scope="module")
async def played(engine: Engine, container_dir: Path) -> AsyncIterator[Played]:
    if engine.name != "podman" or shutil.which("podman") is None:
        unavailable("`podman kube play` needs podman")
    from tests.integration.test_helm_chart import render

    values = chart_values()
    objects = render(values)
    folder = container_dir / "kube-play"
    folder.mkdir()
    manifest_objects, containers = kubelet_stand_in(objects, folder,
                                                    values["redis"]["port"])
    manifest = folder / "chart.yaml"
    manifest.write_text(yaml.safe_dump_all(manifest_objects))
    api_keys = secret_data(objects)["demo-pdserve-api-keys"]["api-keys"].decode()
    api_key = api_keys.splitlines()[0].split(":", 1)[1]
    result = Played(engine, manifest, values, api_key, containers)
    try:
        engine.cmd("kube", "play", "--network", "host", str(manifest))
        await wait_probes(result, START_TIMEOUT_S)
        yield result
    finally:
        (folder / "pods.log").write_text(result.logs())
        engine.cmd("kube", "down", str(manifest), check=False)


async def test_chart_serves_through_its_router(played: Played) -> None:
    async with PdserveClient(played.target, api_key=played.api_key) as client:
        result = await client.generate(chat=[("user", "What is the capital of France?")],
                                       temperature=0.0, max_tokens=32)
    assert "Paris" in result.text
    async with PdserveClient(played.target) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate(text="Hello", max_tokens=2)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_liveness_probes_answer(played: Played) -> None:
    for _, container in played.containers:
        probe = container.get("livenessProbe", {})
        if "grpc" in probe:
            assert await probe_serving(probe["grpc"]["port"], probe["grpc"].get("service", "")), \
                container["name"]


def test_pods_run_as_the_charts_user(played: Played) -> None:
    for pod, container in played.containers:
        name = f"{pod}-pod-0-{container['name']}"
        uid = played.engine.cmd("exec", name, "id", "-u").stdout.strip()
        assert uid == str(IMAGE_UID) or container["name"] == "redis", (name, uid)
