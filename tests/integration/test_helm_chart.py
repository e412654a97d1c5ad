"""Kubernetes and cluster deployment: the Helm chart (helm/pdserve) rendered by the real
Helm engine (Helm's Go SDK, through the `helm-python-sdk` wheel), every rendered object
checked against the Kubernetes API schemas (`kubernetes-validate`), and the deploy/
files (Dockerfiles, compose file, Ray cluster config, Grafana dashboard) checked against
pdserve's own settings models, CLI and metrics.

No cluster, container engine or vLLM engine is involved: what runs is Helm's template
engine, its values.schema.json validation and its linter, in a child process.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import ipaddress
import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
DEPLOY = ROOT / "deploy"
RELEASE, NAMESPACE = "demo", "llm"
FULLNAME = f"{RELEASE}-pdserve"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: native gRPC probes
# are GA in 1.27) and the version Helm's offline rendering assumes (v1.36).
KUBE_VERSIONS = ("1.27.0", "1.36.0")
ROLES = ("router", "prefill", "decode")
CRD_KINDS = {"ServiceMonitor", "ScaledObject", "RayCluster", "Certificate", "Issuer"}
# Why the custom resources are not validated against their CRDs' own schemas.
CRD_SKIP_REASON = (
    "the CRD schemas of ServiceMonitor (prometheus-operator), ScaledObject (KEDA), "
    "RayCluster (KubeRay) and Certificate/Issuer (cert-manager) are not installable "
    "offline from the registries this project "
    "uses: no PyPI package for Python 3.11 ships them (cloudcoil-models-keda and "
    "-prometheus-operator need Python >= 3.14; nothing ships KubeRay's), and the npm "
    "kubernetes-models packages carry JavaScript validators, not schemas. What can be "
    "checked is: RayCluster pod templates against core/v1 PodTemplateSpec, and the "
    "fields each CRD requires, in test_custom_resources_structure."
)

HELM_INSTALL = ("install the dev extra's helm-python-sdk==0.2.2, a wheel bundling Helm's "
                "Go SDK (v4.2.3); without it the chart cannot be rendered, so the chart "
                "tests do not run")
needs_helm = pytest.mark.skipif(importlib.util.find_spec("helm_python") is None,
                                reason=f"the Helm engine is not installed: {HELM_INSTALL}")

# Helm runs in a child process: its Go runtime (threads, signal handlers) stays out of the
# pytest process, which also hosts vLLM engines and gRPC servers in the same session.
_HELM_CHILD = r"""
import json, sys
try:
    import helm_python as helm
    version = helm.helm_sdk_version()  # loads the bundled native library
except Exception as e:
    print(json.dumps({"error": {"type": type(e).__name__, "message": str(e)}}), flush=True)
    sys.exit(0)
path, name, namespace = sys.argv[1:4]
chart = helm.Chart.load(path)
print(json.dumps({"ok": version}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    values = request.get("values")
    try:
        if request["op"] == "render":
            result = chart.render(values, name=name, namespace=namespace)
        elif request["op"] == "lint":
            result = helm.lint(path, values, strict=True, namespace=namespace,
                               kube_version=request["kube_version"])
        else:
            result = chart.validate_schema(values)
        reply = {"ok": result}
    except helm.HelmError as e:
        reply = {"error": {"type": type(e).__name__, "message": str(e)}}
    print(json.dumps(reply), flush=True)
"""


class HelmFailure(Exception):
    """Helm refused: `kind` is the SDK's error class (HelmValuesError: values.schema.json;
    HelmRenderError: a template's `fail`/`required`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@functools.lru_cache(maxsize=1)
def _start_helm() -> tuple[Any, str]:
    """The child process, or why it could not start."""
    import atexit
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-c", _HELM_CHILD, str(CHART), RELEASE, NAMESPACE],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    atexit.register(child.kill)
    hello = json.loads(child.stdout.readline() or "{}")  # type: ignore[union-attr]
    if "ok" in hello:
        return child, ""
    error = hello.get("error", {"type": "exit", "message": "no answer"})
    return None, (f"the Helm engine does not load here ({error['type']}: "
                  f"{error['message']}): {HELM_INSTALL}")


def _helm() -> Any:
    child, why_not = _start_helm()
    if child is None:
        pytest.skip(why_not)
    return child


def helm_call(op: str, values: dict[str, Any] | None, **extra: Any) -> Any:
    child = _helm()
    child.stdin.write(json.dumps({"op": op, "values": values, **extra}) + "\n")
    child.stdin.flush()
    reply = json.loads(child.stdout.readline())
    if "error" in reply:
        raise HelmFailure(reply["error"]["type"], reply["error"]["message"])
    return reply["ok"]


# -- rendering ------------------------------------------------------------------------
SCENARIOS = ["default", *sorted(p.stem.removesuffix("-values") for p in (CHART / "ci").glob(
    "*-values.yaml"))]


def scenario_values(name: str) -> dict[str, Any]:
    if name == "default":
        return {}
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text()) or {}


def render_files(values: dict[str, Any]) -> dict[str, str]:
    return dict(helm_call("render", values))


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    objects = []
    for path, text in sorted(render_files(values).items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


@functools.cache
def rendered(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(scenario_values(name)))


def find(objects: Any, kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} rendered"
    return matches[0]


def kinds(objects: Any) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objects}


def pod_specs(objects: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod template) of every workload, RayCluster groups included."""
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]
        elif o["kind"] == "RayCluster":
            yield "RayCluster head", o["spec"]["headGroupSpec"]["template"]
            for group in o["spec"]["workerGroupSpecs"]:
                yield f"RayCluster group {group['groupName']}", group["template"]


def config_maps(objects: Any) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}


def container_env(container: dict[str, Any], objects: Any) -> dict[str, str]:
    """The environment the kubelet would give `container`: its ConfigMaps, then its env
    (downward API and Secrets replaced by sample values, $(VAR) references expanded)."""
    cms = config_maps(objects)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(cms[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]),
                                      var["value"])
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = "10.1.2.3"
        else:
            env[var["name"]] = "s3cret"
    return env


# -- Kubernetes schemas ---------------------------------------------------------------
@functools.cache
def _k8s_schema_file(version: str, name: str) -> Any:
    from importlib.resources import files

    path = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict"
    return json.loads((path / name).read_text())


@functools.cache
def _k8s_validator(version: str, schema_file: str) -> Any:
    import jsonschema
    from referencing import Registry, Resource

    schema = _k8s_schema_file(version, schema_file)
    definitions = Resource.from_contents(_k8s_schema_file(version, "_definitions.json"))
    registry = definitions @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def k8s_schema_file(obj: dict[str, Any]) -> str:
    # kubernetes-validate's file names: apps/v1 Deployment -> deployment-apps-v1.json
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", obj["apiVersion"])
    return f"{obj['kind'].lower()}-{api}.json"


def k8s_errors(obj: dict[str, Any], version: str, schema_file: str | None = None) -> list[str]:
    validator = _k8s_validator(version, schema_file or k8s_schema_file(obj))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(obj)]


# -- pdserve's settings and CLI ---------------------------------------------------------
@functools.lru_cache(maxsize=1)
def settings_models() -> dict[str, Any]:
    from services import config_doc

    models = {m.__name__: m for m in config_doc.settings_models()}
    assert set(models) >= {name for names in COMMAND_MODELS.values() for name in names}
    return models


@functools.lru_cache(maxsize=1)
def settings_env_names() -> frozenset[str]:
    from services.registry.signing import SECRET_ENV, SECRET_FILE_ENV
    from services.security.apikeys import ENV_VAR as API_KEYS_ENV
    from services.settings import env_name

    # Besides the settings models: the variables the code reads itself (the cluster
    # secret, read where records are signed; extra API keys).
    read_directly = {SECRET_ENV, SECRET_FILE_ENV, API_KEYS_ENV}
    return frozenset({env_name(model, field) for model in settings_models().values()
                      for field in model.model_fields} | read_directly)


@functools.lru_cache(maxsize=1)
def parser() -> argparse.ArgumentParser:
    from services.cli import build_parser

    return build_parser()


# The settings each pdserve subcommand reads (services/cli.py).
COMMAND_MODELS = {
    "router": ("RouterConfig", "ServerConfig"),
    "prefill": ("EngineConfig", "ServerConfig", "WorkerConfig"),
    "decode": ("EngineConfig", "ServerConfig", "WorkerConfig"),
    "up": ("LauncherConfig", "RouterConfig", "EngineConfig", "WorkerConfig", "ServerConfig"),
}


def check_pdserve_command(argv: list[str], env: dict[str, str],
                          monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Parse `pdserve <argv>` as the CLI does and build its settings from `env` and the
    flags: a setting pdserve does not have, or a value it refuses, fails here."""
    from services.settings import from_arguments

    unknown = sorted(k for k in env if k.startswith("PDSERVE_") and k not in settings_env_names())
    assert not unknown, f"not pdserve settings: {unknown}"
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"`pdserve {' '.join(argv)}` does not parse") from e
    assert args.command in COMMAND_MODELS, f"{args.command}: not a service command"
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("PDSERVE_")]:
            m.delenv(key)
        for key, value in env.items():
            if key.startswith("PDSERVE_"):
                m.setenv(key, value)
        return {name: from_arguments(settings_models()[name], args)
                for name in COMMAND_MODELS[args.command]}


def with_settings_file(argv: list[str], template: dict[str, Any], objects: Any,
                       tmp_path: Path) -> list[str]:
    """`argv` with its `--config` path (a file the pod mounts from a ConfigMap) replaced by
    a copy of that file under `tmp_path`, so pdserve reads what the pod would."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config") + 1
    directory, name = argv[at].rsplit("/", 1)
    (container,) = [c for c in template["spec"]["containers"]
                    if any(m["mountPath"] == directory for m in c.get("volumeMounts", []))]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
    copy = tmp_path / f"{volume['configMap']['name']}-{name}"
    copy.write_text(config_maps(objects)[volume["configMap"]["name"]][name])
    return [*argv[:at], str(copy), *argv[at + 1:]]


def pdserve_argv_from_shell(script: str) -> list[str]:
    """`pdserve ...` as a shell command line runs it (after `exec`)."""
    words = shlex.split(script.replace(";", " ; ").replace("&&", " && "))
    start = words.index("pdserve")
    end = next((i for i in range(start, len(words)) if words[i] in (";", "&&", "||")),
               len(words))
    return words[start + 1:end]


def grpc_service_names() -> dict[str, str]:
    from pdserve.v1 import generate_pb2, worker_pb2

    return {
        "router": generate_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
        "prefill": worker_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name,
        "decode": worker_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name,
    }


# ======================================================================================
# The chart renders, and every object is a valid Kubernetes object.
# ======================================================================================
@needs_helm
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_renders_valid_kubernetes_objects(scenario: str) -> None:
    pytest.importorskip("kubernetes_validate", reason="the Kubernetes schemas: install the "
                        "dev extra's kubernetes-validate==1.37.0")
    objects = rendered(scenario)
    assert objects
    problems = []
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert obj["metadata"].get("namespace", NAMESPACE) == NAMESPACE, where
        if obj["kind"] in CRD_KINDS:
            continue  # test_custom_resources_structure
        for version in KUBE_VERSIONS:
            problems += [f"{where} (Kubernetes {version}) {e}" for e in k8s_errors(obj, version)]
    for where, template in pod_specs(objects):
        if where.startswith("RayCluster"):
            for version in KUBE_VERSIONS:
                problems += [f"{where} (Kubernetes {version}) {e}" for e in
                             k8s_errors(template, version, "podtemplatespec-v1.json")]
    assert not problems, "\n".join(problems)
    names = kinds(objects)
    assert len(names) == len(objects), "two objects share a kind and name"


@needs_helm
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint_is_clean(scenario: str) -> None:
    for version in KUBE_VERSIONS:
        report = helm_call("lint", scenario_values(scenario), kube_version=f"v{version}")
        findings = [m for m in report["messages"] if m["severity"] >= 2]
        assert not findings and not report["errors"], (version, findings, report["errors"])


@needs_helm
def test_default_release_has_every_part() -> None:
    names = kinds(rendered("default"))
    for role in ROLES:
        assert ("Deployment", f"{FULLNAME}-{role}") in names
        assert ("Service", f"{FULLNAME}-{role}") in names
        assert ("ConfigMap", f"{FULLNAME}-{role}") in names
        assert ("PodDisruptionBudget", f"{FULLNAME}-{role}") in names
        assert ("NetworkPolicy", f"{FULLNAME}-{role}") in names
    assert {("StatefulSet", f"{FULLNAME}-redis"), ("Service", f"{FULLNAME}-redis"),
            ("NetworkPolicy", f"{FULLNAME}-redis"), ("ServiceAccount", FULLNAME)} <= names
    # Off by default: they need operators that may not be installed.
    assert not {k for k, _ in names} & {"ServiceMonitor", "ScaledObject", "RayCluster",
                                        "HorizontalPodAutoscaler"}
    notes = render_files({})["pdserve/templates/NOTES.txt"]
    assert f"svc/{FULLNAME}-router" in notes and "port-forward" in notes


@needs_helm
def test_router_service_exposes_grpc_http_and_metrics() -> None:
    service = find(rendered("default"), "Service", f"{FULLNAME}-router")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"grpc": 50051, "http": 8000, "metrics": 9400}
    data = config_maps(rendered("default"))[f"{FULLNAME}-router"]
    assert data["PDSERVE_HTTP_PORT"] == "8000"


# ======================================================================================
# One source of truth: every PDSERVE_* variable is a pdserve setting, and every
# container command is a real `pdserve` subcommand whose settings validate.
# ======================================================================================
@needs_helm
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_containers_run_pdserve_with_valid_settings(
        scenario: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    objects = rendered(scenario)
    seen = set()
    for name, data in config_maps(objects).items():
        if name.endswith("-file"):  # a settings file (test_settings_files_reach_pdserve)
            assert set(data) == {"pdserve.yaml"}, name
            continue
        unknown = sorted(k for k in data if k not in settings_env_names())
        assert not unknown, f"ConfigMap keys that are no pdserve setting: {unknown}"
    for where, template in pod_specs(objects):
        for container in template["spec"]["containers"]:
            if container["name"] == "redis":
                continue
            env = container_env(container, objects)
            if "args" in container and "command" not in container:
                argv = list(container["args"])  # the image's entrypoint is pdserve
            elif container["name"] == "ray-worker":
                assert not any(k.startswith("PDSERVE_") for k in env), where
                continue  # runs `ray start`; the launcher sends the settings
            else:
                script = container["args"][-1]
                assert container["command"][0] == "/bin/bash", where
                argv = pdserve_argv_from_shell(script)
            assert "--config" in argv, where
            argv = with_settings_file(argv, template, objects, tmp_path)
            settings = check_pdserve_command(argv, env, monkeypatch)
            seen.add(argv[0])
            if argv[0] in ("router", "prefill", "decode", "up"):
                assert settings["ServerConfig"].host == "0.0.0.0"
                assert settings["RouterConfig" if argv[0] in ("router", "up")
                                else "WorkerConfig"].redis_url.startswith("redis")
            if argv[0] in ("prefill", "decode"):
                worker = settings["WorkerConfig"]
                assert worker.advertise_host == "10.1.2.3"  # the pod's IP
                if argv[0] == "decode":
                    assert worker.kv_advertise_host == "10.1.2.3"
                    assert worker.kv_port > 0  # fixed, so NetworkPolicy can name it
    expected = {"up"} if scenario_values(scenario).get("kuberay", {}).get("enabled") else {
        "router", "prefill", "decode"}
    assert seen == expected


def test_settings_blocks_of_the_schema_match_the_models() -> None:
    spec = importlib.util.spec_from_file_location("chart_schema", DEPLOY / "chart_schema.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    schema = json.loads((CHART / "values.schema.json").read_text())
    for key, definition in module.settings_definitions().items():
        assert schema["definitions"][key] == definition, (
            f"values.schema.json definitions.{key} is stale: run "
            "python deploy/chart_schema.py")


@needs_helm
def test_every_user_setting_reaches_its_configmap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each settings block lands as PDSERVE_<FIELD> in the right role's ConfigMap, with a
    value pdserve parses back to what was given."""
    values = {
        "server": {"grace_s": 12.5, "max_message_bytes": 64 << 20},
        "engine": {"dtype": "float16", "max_model_len": 4096, "enable_prefix_caching": False,
                   "kv_cache_gib": 3, "seed": 7},
        "worker": {"kv_load_timeout_s": 45, "heartbeat_s": 0.5},
        "router": {"settings": {"policy": "round_robin", "max_inflight": 100,
                                "refresh_s": 0.25}},
        "prefill": {"engine": {"max_num_seqs": 8}},
        "decode": {"engine": {"max_num_seqs": 128}, "worker": {"kv_load_failure_policy": "fail"}},
    }
    cms = config_maps(render(values))
    router, prefill, decode = (cms[f"{FULLNAME}-{r}"] for r in ROLES)
    assert router["PDSERVE_POLICY"] == "round_robin" and "PDSERVE_POLICY" not in prefill
    assert router["PDSERVE_MAX_MESSAGE_BYTES"] == str(64 << 20)  # no 6.7108864e+07
    assert prefill["PDSERVE_ENABLE_PREFIX_CACHING"] == "false"
    assert (prefill["PDSERVE_MAX_NUM_SEQS"], decode["PDSERVE_MAX_NUM_SEQS"]) == ("8", "128")
    assert decode["PDSERVE_KV_LOAD_FAILURE_POLICY"] == "fail"
    assert "PDSERVE_KV_LOAD_FAILURE_POLICY" not in prefill
    for role, data in (("prefill", prefill), ("decode", decode)):
        settings = check_pdserve_command([role], data, monkeypatch)
        engine = settings["EngineConfig"]
        assert (engine.dtype, engine.max_model_len, engine.kv_cache_gib, engine.seed) == (
            "float16", 4096, 3, 7)
        assert settings["ServerConfig"].grace_s == 12.5
        assert settings["WorkerConfig"].kv_load_timeout_s == 45
        assert settings["WorkerConfig"].heartbeat_s == 0.5
    router_settings = check_pdserve_command(["router"], router, monkeypatch)["RouterConfig"]
    assert (router_settings.max_inflight, router_settings.refresh_s) == (100, 0.25)


@needs_helm
def test_settings_files_reach_pdserve(monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path) -> None:
    """values.config.<role> is the settings file the role's pdserve starts with; the
    variables the chart sets win over it."""
    values = {
        "engine": {"max_num_seqs": 32},
        "config": {"decode": {"engine": {"max_model_len": 4096, "max_num_seqs": 8},
                              "worker": {"kv_staging_gib": 4}},
                   "router": {"router": {"policy": "round_robin"}}},
    }
    objects = render(values)
    for role in ROLES:
        template = find(objects, "Deployment", f"{FULLNAME}-{role}")["spec"]["template"]
        container = template["spec"]["containers"][0]
        argv = with_settings_file(list(container["args"]), template, objects, tmp_path)
        assert argv[:2] == [role, "--config"]
        settings = check_pdserve_command(argv, container_env(container, objects), monkeypatch)
        if role == "decode":
            engine, worker = settings["EngineConfig"], settings["WorkerConfig"]
            assert engine.max_model_len == 4096 and worker.kv_staging_gib == 4  # the file
            assert engine.max_num_seqs == 32  # the chart's variable beats the file
        elif role == "router":
            assert settings["RouterConfig"].policy == "round_robin"
    files = config_maps(objects)
    assert yaml.safe_load(files[f"{FULLNAME}-prefill-file"]["pdserve.yaml"]) == {}


@needs_helm
def test_a_settings_change_restarts_only_the_pods_it_concerns() -> None:
    def checksums(values: dict[str, Any]) -> dict[str, str]:
        objects = render(values)
        return {r: find(objects, "Deployment", f"{FULLNAME}-{r}")["spec"]["template"][
            "metadata"]["annotations"]["checksum/config"] for r in ROLES}

    base = checksums({})
    router = checksums({"router": {"settings": {"max_inflight": 10}}})
    decode = checksums({"decode": {"engine": {"max_num_seqs": 8}}})
    shared = checksums({"engine": {"max_model_len": 1024}})
    decode_file = checksums({"config": {"decode": {"engine": {"max_num_seqs": 8}}}})
    assert [r for r in ROLES if decode_file[r] != base[r]] == ["decode"]
    assert [r for r in ROLES if router[r] != base[r]] == ["router"]
    assert [r for r in ROLES if decode[r] != base[r]] == ["decode"]
    assert [r for r in ROLES if shared[r] != base[r]] == ["prefill", "decode"]


# ======================================================================================
# Per-role placement, resources, probes.
# ======================================================================================
def pod(objects: Any, role: str) -> dict[str, Any]:
    return find(objects, "Deployment", f"{FULLNAME}-{role}")["spec"]["template"]["spec"]


@needs_helm
def test_gpu_pools_land_on_their_own_nodes() -> None:
    objects = rendered("gpu")
    values = scenario_values("gpu")
    replicas = {r: find(objects, "Deployment", f"{FULLNAME}-{r}")["spec"]["replicas"]
                for r in ROLES}
    assert replicas == {"router": 3, "prefill": 2, "decode": 3}
    for role in ("prefill", "decode"):
        spec = pod(objects, role)
        container = spec["containers"][0]
        assert container["image"] == "pdserve:0.1.0-cuda"
        assert container["resources"] == values[role]["resources"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert spec["nodeSelector"] == values[role]["nodeSelector"]
        assert spec["tolerations"] == values[role]["tolerations"]
        assert spec["runtimeClassName"] == "nvidia"
    assert pod(objects, "prefill")["nodeSelector"] != pod(objects, "decode")["nodeSelector"]
    assert "affinity" in pod(objects, "decode") and "affinity" not in pod(objects, "prefill")
    router = pod(objects, "router")
    assert "nvidia.com/gpu" not in json.dumps(router["containers"][0]["resources"])
    assert "nodeSelector" not in router and "tolerations" not in router
    cms = config_maps(objects)
    prefill, decode = cms[f"{FULLNAME}-prefill"], cms[f"{FULLNAME}-decode"]
    assert prefill["PDSERVE_GPU_MEMORY_UTILIZATION"] == "0.85"
    assert decode["PDSERVE_GPU_MEMORY_UTILIZATION"] == "0.92"
    assert prefill["PDSERVE_DTYPE"] == decode["PDSERVE_DTYPE"] == "bfloat16"
    assert prefill["PDSERVE_MAX_NUM_BATCHED_TOKENS"] == "8192"
    assert "PDSERVE_MAX_NUM_BATCHED_TOKENS" not in decode
    assert decode["PDSERVE_MAX_NUM_SEQS"] == "256" and "PDSERVE_MAX_NUM_SEQS" not in prefill
    # The drain fits in the pod's grace period.
    assert all(pod(objects, r)["terminationGracePeriodSeconds"] > 30 for r in ROLES)


@needs_helm
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "kuberay"])
def test_probes_ask_each_role_its_own_grpc_service_on_its_port(scenario: str) -> None:
    objects = rendered(scenario)
    services = grpc_service_names()
    cms = config_maps(objects)
    for role in ROLES:
        container = pod(objects, role)["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        data = cms[f"{FULLNAME}-{role}"]
        assert ports["grpc"] == int(data["PDSERVE_PORT"])
        assert ports["metrics"] == int(data["PDSERVE_METRICS_PORT"])
        # The kubelet's gRPC probes speak neither TLS nor API keys: they ask the
        # plaintext health-only port.
        assert ports["health"] == int(data["PDSERVE_HEALTH_PORT"]) != ports["grpc"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            assert set(probe) >= {"grpc", "periodSeconds", "failureThreshold"}, kind
            assert probe["grpc"]["port"] == ports["health"], (role, kind)
        assert container["startupProbe"]["grpc"]["service"] == services[role]
        assert container["readinessProbe"]["grpc"]["service"] == services[role]
        assert container["livenessProbe"]["grpc"]["service"] == ""  # overall health
        start = container["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 600, role
        service = find(objects, "Service", f"{FULLNAME}-{role}")
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (role, port)
            assert port["port"] == ports[port["targetPort"]], (role, port)
    decode = pod(objects, "decode")["containers"][0]
    kv = {p["name"]: p["containerPort"] for p in decode["ports"]}["kv"]
    assert kv == int(cms[f"{FULLNAME}-decode"]["PDSERVE_KV_PORT"])


@needs_helm
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_pods_run_as_non_root_without_service_links(scenario: str) -> None:
    for where, template in pod_specs(rendered(scenario)):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] != 0, where
        assert spec["automountServiceAccountToken"] is False, where
        # Service links would set e.g. PDSERVE_PORT=tcp://... for a Service named pdserve.
        assert spec["enableServiceLinks"] is False, where
        # (the in-chart Redis with persistence mounts a volumeClaimTemplate: data)
        mounts = {v["name"] for v in spec.get("volumes", [])} | (
            {"data"} if where.startswith("StatefulSet") else set())
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert {m["name"] for m in container["volumeMounts"]} <= mounts, where


@needs_helm
@pytest.mark.parametrize("scenario", ["pvc", "hostPath", "image"])
def test_model_source(scenario: str) -> None:
    cases: dict[str, dict[str, Any]] = {
        "pvc": {"model": {"source": "pvc", "path": "/models/m", "pvc": {"claimName": "llms",
                                                                        "subPath": "v1"}}},
        "hostPath": {"model": {"source": "hostPath", "mountPath": "/srv/models",
                               "path": "/srv/models/m", "hostPath": {"path": "/data/llm"}}},
        "image": {"model": {"path": "/opt/model"}},
    }
    values = cases[scenario]
    objects = render(values)
    for role in ROLES:
        spec = pod(objects, role)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
        env = container_env(spec["containers"][0], objects)
        key = "PDSERVE_ROUTER_MODEL" if role == "router" else "PDSERVE_MODEL"
        assert env[key] == values["model"]["path"]
        if scenario == "image":
            assert "model" not in volumes and "model" not in mounts
            continue
        assert mounts["model"]["readOnly"] is True
        if scenario == "pvc":
            assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "llms",
                                                                 "readOnly": True}
            assert mounts["model"]["mountPath"] == "/models"
            assert mounts["model"]["subPath"] == "v1"
        else:
            assert volumes["model"]["hostPath"] == {"path": "/data/llm", "type": "Directory"}
            assert mounts["model"]["mountPath"] == "/srv/models"


@needs_helm
def test_external_redis_password_comes_from_the_secret() -> None:
    objects = rendered("external-redis")
    names = kinds(objects)
    assert not any(n.endswith("-redis") for _, n in names), "no in-chart Redis"
    for role in ROLES:
        container = pod(objects, role)["containers"][0]
        env = {v["name"]: v for v in container["env"]}
        order = [v["name"] for v in container["env"]]
        # $(REDIS_PASSWORD) expands only from variables defined before it.
        assert order.index("REDIS_PASSWORD") < order.index("PDSERVE_REDIS_URL")
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "pdserve-redis", "key": "password"}
        assert env["PDSERVE_REDIS_URL"]["value"] == (
            "rediss://:$(REDIS_PASSWORD)@redis.example.internal:6380/2")
        assert "s3cret" not in json.dumps(objects)
        url = container_env(container, objects)["PDSERVE_REDIS_URL"]
        assert url == "rediss://:s3cret@redis.example.internal:6380/2"


@needs_helm
def test_in_chart_redis_with_a_password() -> None:
    objects = rendered("hostpath")
    redis = find(objects, "StatefulSet", f"{FULLNAME}-redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert {v["name"] for v in container["env"]} == {"REDIS_PASSWORD", "REDISCLI_AUTH"}
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"] == {
        "storage": "2Gi"}
    env = container_env(pod(objects, "prefill")["containers"][0], objects)
    assert env["PDSERVE_REDIS_URL"] == f"redis://:s3cret@{FULLNAME}-redis.{NAMESPACE}.svc:6379/0"


# ======================================================================================
# NetworkPolicy: only the intended paths are open.
# ======================================================================================
def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        present, value = expr["key"] in labels, labels.get(expr["key"])
        ok = {"In": present and value in expr.get("values", []),
              "NotIn": not present or value not in expr.get("values", []),
              "Exists": present, "DoesNotExist": not present}[expr["operator"]]
        if not ok:
            return False
    return True


def ingress_allowed(policies: list[dict[str, Any]], target: dict[str, Any], port: int,
                    source: dict[str, Any]) -> bool:
    """Kubernetes NetworkPolicy semantics for one TCP connection: `target` and `source`
    are {"labels", "namespace", "ip", "ports" (name -> number)}."""
    selecting = [p for p in policies if p["metadata"]["namespace"] == target["namespace"]
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _selects(p["spec"]["podSelector"], target["labels"])]
    if not selecting:
        return True  # not isolated
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(
                    (target["ports"].get(p["port"]) if isinstance(p["port"], str)
                     else p["port"]) == port and p.get("protocol", "TCP") == "TCP"
                    for p in ports):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                if "ipBlock" in peer:
                    net = ipaddress.ip_network(peer["ipBlock"]["cidr"])
                    if ipaddress.ip_address(source["ip"]) in net:
                        return True
                    continue
                if "namespaceSelector" in peer:
                    ns_ok = _selects(peer["namespaceSelector"],
                                     {"kubernetes.io/metadata.name": source["namespace"]})
                else:
                    ns_ok = source["namespace"] == policy["metadata"]["namespace"]
                pod_ok = _selects(peer.get("podSelector", {}), source["labels"])
                if ns_ok and pod_ok:
                    return True
    return False


def endpoints(objects: Any) -> dict[str, dict[str, Any]]:
    """The pods of each component, as the NetworkPolicy evaluator sees them."""
    found = {}
    for _, template in pod_specs(objects):
        labels = template["metadata"]["labels"]
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
                 for p in c.get("ports", [])}
        found[labels["app.kubernetes.io/component"]] = {
            "labels": labels, "namespace": NAMESPACE, "ip": "10.1.2.3", "ports": ports}
    return found


STRANGER = {"labels": {"app": "something-else"}, "namespace": NAMESPACE, "ip": "10.9.9.9",
            "ports": {}}
ELSEWHERE = {"labels": {"app": "prometheus"}, "namespace": "monitoring", "ip": "10.8.8.8",
             "ports": {}}


@needs_helm
@pytest.mark.parametrize("scenario", ["default", "hostpath"])
def test_network_policy_opens_only_the_intended_paths(scenario: str) -> None:
    objects = rendered(scenario)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = endpoints(objects)
    router, prefill, decode, redis = (pods[c] for c in ("router", "prefill", "decode", "redis"))
    torch = scenario == "hostpath"  # kv_transport: torch

    def can(source: dict[str, Any], target: dict[str, Any], port: int | str) -> bool:
        number = target["ports"][port] if isinstance(port, str) else port
        return ingress_allowed(policies, target, number, source)

    # The router's public ports.
    if scenario == "default":
        assert can(STRANGER, router, "grpc") and can(ELSEWHERE, router, "http")
    else:  # networkPolicy.router: the ingress-nginx namespace only
        assert not can(STRANGER, router, "grpc") and not can(ELSEWHERE, router, "http")
        assert can({**ELSEWHERE, "namespace": "ingress-nginx"}, router, "grpc")
    # Worker APIs: from the router only (with torch.distributed, the other pool reaches
    # every port: its ephemeral ports cannot be told apart from the API's).
    for worker in (prefill, decode):
        assert can(router, worker, "grpc")
        for other in (STRANGER, ELSEWHERE, redis):
            assert not can(other, worker, "grpc")
        assert can(prefill if worker is decode else decode, worker, "grpc") is torch
    # KV: from prefill workers only.
    assert can(prefill, decode, "kv")
    for other in (router, STRANGER, ELSEWHERE, redis):
        assert not can(other, decode, "kv")
    # torch.distributed: ephemeral ports between the two pools, both ways; nothing else.
    assert can(prefill, decode, 41234) is torch
    assert can(decode, prefill, 41234) is torch
    assert not can(router, decode, 41234) and not can(STRANGER, prefill, 41234)
    assert not can(router, prefill, 14579) and not can(STRANGER, decode, 41234)
    # Redis: from pdserve pods only.
    for client in (router, prefill, decode):
        assert can(client, redis, "redis")
    for other in (STRANGER, ELSEWHERE, {**router, "namespace": "other"}):
        assert not can(other, redis, "redis")
    # Metrics (unauthenticated): from this namespace only unless networkPolicy.metrics
    # says otherwise; health (status only, for the kubelet): from anywhere.
    for pod in (router, prefill, decode):
        assert can(STRANGER, pod, "metrics") and not can(ELSEWHERE, pod, "metrics")
        assert can(ELSEWHERE, pod, "health")
        assert not can(ELSEWHERE, pod, 6379)  # nothing else


@needs_helm
def test_network_policy_metrics_from_monitoring_only() -> None:
    objects = rendered("monitoring")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = endpoints(objects)
    for role in ROLES:
        target = pods[role]
        assert ingress_allowed(policies, target, target["ports"]["metrics"], ELSEWHERE)
        assert not ingress_allowed(policies, target, target["ports"]["metrics"], STRANGER)


@needs_helm
def test_network_policy_kuberay_mode() -> None:
    objects = rendered("kuberay")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = endpoints(objects)
    head, prefill, decode = (pods[f"ray-{r}"] for r in ("head", "prefill", "decode"))
    for a in (head, prefill, decode):
        for b in (head, prefill, decode):
            assert ingress_allowed(policies, b, 6379, a)  # Ray's ports, in every direction
        assert not ingress_allowed(policies, a, 6379, STRANGER)
    assert ingress_allowed(policies, head, 50051, STRANGER)  # the router
    assert not ingress_allowed(policies, decode, 14579, STRANGER)
    assert ingress_allowed(policies, pods["redis"], 6379, decode)
    assert not ingress_allowed(policies, pods["redis"], 6379, STRANGER)


# ======================================================================================
# Autoscaling, monitoring, KubeRay.
# ======================================================================================
@needs_helm
def test_autoscaling_on_queue_metrics() -> None:
    objects = rendered("monitoring")
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    for role in ROLES:  # the autoscaler owns the replica count
        assert "replicas" not in find(objects, "Deployment", f"{FULLNAME}-{role}")["spec"]
    hpa = find(objects, "HorizontalPodAutoscaler", f"{FULLNAME}-router")["spec"]
    assert hpa["scaleTargetRef"]["name"] in deployments
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert hpa["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "pdserve_router_inflight"},
        "target": {"type": "AverageValue", "averageValue": "64"}}}]
    for role, (low, high, threshold) in {"prefill": (1, 8, "4"), "decode": (2, 10, "8")}.items():
        so = find(objects, "ScaledObject", f"{FULLNAME}-{role}")["spec"]
        assert so["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": f"{FULLNAME}-{role}"}
        assert (so["minReplicaCount"], so["maxReplicaCount"]) == (low, high)
        (trigger,) = so["triggers"]
        assert trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert meta["threshold"] == threshold
        assert meta["query"] == (
            f'sum(vllm:num_requests_waiting{{namespace="{NAMESPACE}",'
            f'service="{FULLNAME}-{role}"}})')
        assert meta["serverAddress"].startswith("http")
    assert find(objects, "ScaledObject", f"{FULLNAME}-prefill")["spec"]["advanced"][
        "horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"] == 600


@needs_helm
def test_service_monitor_scrapes_every_metrics_port() -> None:
    objects = rendered("monitoring")
    sm = find(objects, "ServiceMonitor", FULLNAME)
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selected = [o for o in objects if o["kind"] == "Service"
                and _selects(sm["spec"]["selector"], o["metadata"]["labels"])]
    assert {o["metadata"]["name"] for o in selected} == {f"{FULLNAME}-{r}" for r in ROLES}
    (endpoint,) = sm["spec"]["endpoints"]
    for service in selected:
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


@needs_helm
def test_kuberay_mode_renders_a_raycluster_the_launcher_can_fill() -> None:
    from services.launcher.actor_spec import RayOptions
    from services.launcher.settings import LauncherConfig

    objects = rendered("kuberay")
    values = scenario_values("kuberay")
    names = kinds(objects)
    assert not any(k in ("Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget")
                   for k, _ in names)
    cluster = find(objects, "RayCluster", FULLNAME)
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"

    # What the launcher's actors ask Ray for, per role.
    wanted = {role: RayOptions.of(LauncherConfig(), role, f"{role}-0").kwargs()["resources"]
              for role in ("prefill", "decode", "router")}

    def ray_resources(params: dict[str, str]) -> dict[str, int]:
        # KubeRay's format: a JSON object inside double quotes, on the ray start line.
        return dict(json.loads(json.loads(params["resources"])))

    head = ray_resources(cluster["spec"]["headGroupSpec"]["rayStartParams"])
    assert set(head) == set(wanted["router"])
    assert head["pdserve_router"] == values["kuberay"]["launcher"]["routers"]
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, group in groups.items():
        assert set(ray_resources(group["rayStartParams"])) == set(wanted[role])
        assert group["replicas"] == group["minReplicas"] == values[role]["replicas"]
        assert group["maxReplicas"] == values["kuberay"]["maxReplicas"][role]
        assert group["template"]["spec"]["nodeSelector"] == values[role]["nodeSelector"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    launcher = config_maps(objects)[f"{FULLNAME}-launcher"]
    assert launcher["PDSERVE_PREFILL"] == "2" and launcher["PDSERVE_DECODE"] == "3"
    # The router Service selects the head pod, where the first router actor listens.
    service = find(objects, "Service", f"{FULLNAME}-router")
    head_labels = cluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert _selects({"matchLabels": service["spec"]["selector"]}, head_labels)
    head_container = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert pdserve_argv_from_shell(head_container["args"][0]) == [
        "up", "--ray-address", "auto", "--config", "/etc/pdserve/config/pdserve.yaml"]
    assert "KUBERAY_GEN_RAY_START_CMD//--block/" in head_container["args"][0]


@needs_helm
def test_custom_resources_structure() -> None:
    """The fields each CRD requires, and map[string]string fields as strings."""
    for scenario in ("monitoring", "kuberay"):
        for obj in rendered(scenario):
            kind = obj["kind"]
            if kind == "ServiceMonitor":
                assert obj["apiVersion"] == "monitoring.coreos.com/v1"
                assert obj["spec"]["selector"]["matchLabels"]
                assert all("port" in e for e in obj["spec"]["endpoints"])
            elif kind == "ScaledObject":
                assert obj["apiVersion"] == "keda.sh/v1alpha1"
                assert obj["spec"]["scaleTargetRef"]["name"]
                for trigger in obj["spec"]["triggers"]:
                    assert trigger["type"] and trigger["metadata"]
                    assert all(isinstance(v, str) for v in trigger["metadata"].values())
            elif kind == "RayCluster":
                assert obj["apiVersion"] == "ray.io/v1"
                spec = obj["spec"]
                assert re.fullmatch(r"\d+\.\d+\.\d+", spec["rayVersion"])
                for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
                    assert all(isinstance(v, str) for v in group["rayStartParams"].values())
                    assert group["template"]["spec"]["containers"]


def test_custom_resources_against_crd_schemas() -> None:
    pytest.skip(CRD_SKIP_REASON)


def test_raycluster_uses_the_ray_of_the_lock() -> None:
    lock = (ROOT / "requirements" / "cpu.lock").read_text()
    ray_version = re.search(r"^ray==(\S+)$", lock, re.M)
    assert ray_version is not None
    assert yaml.safe_load((CHART / "values.yaml").read_text())["kuberay"]["rayVersion"] == (
        ray_version[1])


# ======================================================================================
# values.schema.json: bad values fail with a message naming the value.
# ======================================================================================
@pytest.mark.parametrize(("values", "message"), [
    ({"prefill": {"replicas": -1}}, "/prefill/replicas': minimum"),
    ({"prefil": {"replicas": 1}}, "additional properties 'prefil' not allowed"),
    ({"engine": {"dtype": "int3"}}, "/engine/dtype'"),
    ({"engine": {"model": "/models/x"}}, "additional properties 'model' not allowed"),
    ({"prefill": {"engine": {"max_model_len": 8}}}, "/prefill/engine/max_model_len': minimum"),
    ({"decode": {"engine": {"gpu_memory_utilization": 1.5}}}, "gpu_memory_utilization"),
    ({"worker": {"kv_transport": "rdma"}}, "/worker/kv_transport'"),
    ({"decode": {"worker": {"kv_port": 1}}}, "additional properties 'kv_port' not allowed"),
    ({"router": {"settings": {"policy": "random"}}}, "/router/settings/policy'"),
    ({"router": {"server": {"port": 1}}}, "additional properties 'port' not allowed"),
    ({"kuberay": {"launcher": {"prefill": 3}}}, "additional properties 'prefill' not allowed"),
    ({"config": {"prefill": {"engine": {"kv_cache_gb": 2}}}},
     "additional properties 'kv_cache_gb' not allowed"),
    ({"config": {"decode": {"enigne": {}}}}, "additional properties 'enigne' not allowed"),
    ({"config": {"router": {"server": {"port": 1}}}}, "additional properties 'port' not allowed"),
    ({"config": {"decode": {"worker": {"kv_transport": "rdma"}}}},
     "/config/decode/worker/kv_transport'"),
    ({"decode": {"resources": {"limits": {"nvidia.com/gpu": "two"}}}}, "nvidia.com~1gpu"),
    ({"decode": {"ports": {"kv": 70000}}}, "/decode/ports/kv': maximum"),
    ({"model": {"source": "s3"}}, "/model/source'"),
    ({"model": {"path": "models/x"}}, "/model/path'"),
    ({"prefill": {"extraEnv": [{"name": "PDSERVE_MODEL", "value": "/x"}]}},
     "/prefill/extraEnv/0/name'"),
    ({"externalRedis": {"url": "http://redis:6379"}}, "/externalRedis/url'"),
    ({"prefill": {"autoscaling": {"provider": "vpa"}}}, "/prefill/autoscaling/provider'"),
    ({"image": {"flavor": "rocm"}}, "/image/flavor'"),
])
@needs_helm
def test_schema_rejects_bad_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmFailure) as failure:
        render(values)
    assert failure.value.kind == "HelmValuesError"
    assert "values don't meet the specifications of the schema" in str(failure.value)
    assert message in str(failure.value), str(failure.value)


@pytest.mark.parametrize(("values", "message"), [
    ({"model": {"source": "pvc"}}, "model.pvc.claimName is required when model.source is pvc"),
    ({"model": {"source": "hostPath", "path": "/models/x"}}, "model.hostPath.path is required"),
    ({"model": {"source": "pvc", "path": "/opt/x", "pvc": {"claimName": "c"}}},
     "model.path (/opt/x) must lie under model.mountPath (/models)"),
    ({"redis": {"enabled": False}}, "externalRedis.url is required when redis.enabled is false"),
    ({"redis": {"enabled": False}, "externalRedis": {"url": "redis://u:pw@redis:6379/0"}},
     "externalRedis.url must not carry credentials"),
    ({"engine": {"max_num_seqs": 64, "max_num_batched_tokens": 32}},
     "engine max_num_batched_tokens (32) must be >= max_num_seqs (64)"),
    ({"server": {"grace_s": 90}}, "terminationGracePeriodSeconds (60) must exceed server grace_s"),
    ({"decode": {"ports": {"kv": 50051}}}, "decode.ports: grpc and kv are both 50051"),
    ({"prefill": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "prefill.autoscaling.minReplicas (5) exceeds maxReplicas (2)"),
    ({"kuberay": {"enabled": True}, "prefill": {"engine": {"max_num_seqs": 8}}},
     "kuberay.enabled: prefill.engine is not used"),
    ({"kuberay": {"enabled": True}, "config": {"decode": {"engine": {"max_num_seqs": 8}}}},
     "kuberay.enabled: config.decode is not used"),
    ({"config": {"launcher": {"launcher": {"routers": 2}}}},
     "config.launcher is used with kuberay.enabled only"),
])
@needs_helm
def test_inconsistent_values_fail_with_a_clear_message(values: dict[str, Any],
                                                       message: str) -> None:
    with pytest.raises(HelmFailure) as failure:
        render(values)
    assert failure.value.kind == "HelmRenderError"
    assert message in str(failure.value), str(failure.value)


def test_values_file_and_schema_agree() -> None:
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)


@needs_helm
def test_example_values_pass_helms_schema_check() -> None:
    for name in SCENARIOS:
        helm_call("validate_schema", scenario_values(name))


# ======================================================================================
# deploy/: Dockerfiles, compose, Ray cluster config, Grafana dashboard.
# ======================================================================================
def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines: list[str] = []
    current: list[str] = []
    for raw in (DEPLOY / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            lines.append(" ".join(current))
            current = []
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "")
            for ln in lines]


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_are_multi_stage_non_root_with_the_pdserve_entrypoint(name: str) -> None:
    steps = dockerfile(name)
    froms = [args for op, args in steps if op == "FROM"]
    assert len(froms) >= 2 and froms[0].endswith(" AS build")
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    assert any(op == "COPY" and "--from=build" in args for op, args in final)
    user = [args for op, args in final if op == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    (entrypoint,) = [json.loads(args) for op, args in final if op == "ENTRYPOINT"]
    assert entrypoint[-1] == "pdserve"
    assert [json.loads(args) for op, args in final if op == "CMD"] == [["--help"]]
    envs = " ".join(args for op, args in steps if op == "ENV")
    unknown = [n for n in re.findall(r"\bPDSERVE_\w+", envs) if n not in settings_env_names()]
    assert not unknown
    exposed = {int(p) for op, args in final if op == "EXPOSE" for p in args.split()}
    assert {50051, 8000, 9400, 14579} <= exposed
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    for path in ("pyproject.toml", "README.md", "proto/", "services/"):
        assert f"!{path}" in ignore


def test_cpu_image_installs_the_lock_as_the_makefile_does() -> None:
    runs = [args for op, args in dockerfile("Dockerfile.cpu") if op == "RUN"]
    text = "\n".join(runs)
    assert re.search(r"pip install --no-deps [^\n]*-r requirements/cpu\.lock", text)
    assert re.search(r"pip install --no-deps \.(\s|$)", text)
    makefile = (ROOT / "Makefile").read_text()
    removed = re.search(r"uninstall -q -y ([\w ]+?) 2>", makefile)
    assert removed is not None
    assert f"pip uninstall -y {removed[1]}" in text
    assert "pdserve model prepare --dest /models/SmolLM2-135M-Instruct-float32" in text
    chart_model = yaml.safe_load((CHART / "values.yaml").read_text())["model"]["path"]
    assert chart_model == "/models/SmolLM2-135M-Instruct-float32"


def test_cuda_image_installs_the_gpu_extra() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    text = "\n".join(args for op, args in dockerfile("Dockerfile.cuda") if op == "RUN")
    assert 'pip install ".[gpu]"' in text and "gpu" in extras


def test_compose_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "router", "prefill", "decode"}
    names = grpc_service_names()
    for role in ROLES:
        service = services[role]
        env = {k: str(v) for k, v in service["environment"].items()}
        settings = check_pdserve_command(service["command"], env, monkeypatch)
        assert service["command"] == [role]
        assert service["user"].split(":")[0] != "0" and service["read_only"] is True
        redis_url = settings["RouterConfig" if role == "router" else "WorkerConfig"].redis_url
        # The password, if any, comes from the environment, never the file itself.
        assert re.fullmatch(r"redis://(:\$\{PDSERVE_REDIS_PASSWORD[^}]*\}@)?redis:6379/0",
                            redis_url), redis_url
        check = service["healthcheck"]["test"]
        assert check[:3] == ["CMD", "python", "-c"] and check[-1] == names[role]
        compile(check[3], "healthcheck", "exec")
        assert f'"127.0.0.1:{settings["ServerConfig"].port}"' in check[3]
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    decode = check_pdserve_command(["decode"], services["decode"]["environment"], monkeypatch)
    assert decode["WorkerConfig"].kv_advertise_host == "decode"
    assert decode["WorkerConfig"].kv_port == 14579
    prefill = check_pdserve_command(["prefill"], services["prefill"]["environment"],
                                    monkeypatch)
    assert prefill["WorkerConfig"].advertise_host == "prefill"
    assert services["prefill"]["cpuset"] != services["decode"]["cpuset"]
    assert services["router"]["build"]["dockerfile"] == "deploy/Dockerfile.cpu"
    ports = {p.rsplit(":", 1)[1] for p in services["router"]["ports"]}
    assert ports == {"50051", "8000", "9400"}
    # Reachable on the compose network, and so behind an API key (from the environment).
    router = check_pdserve_command(["router"], services["router"]["environment"], monkeypatch)
    assert router["ServerConfig"].host == "0.0.0.0"
    assert services["router"]["environment"]["PDSERVE_API_KEYS"].startswith(
        "compose:${PDSERVE_API_KEY:?")


def test_compose_healthcheck_asks_grpc_health() -> None:
    """The compose healthcheck, run against a real grpc.health.v1 server."""
    import subprocess
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    test = compose["services"]["decode"]["healthcheck"]["test"]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code = test[3].replace("127.0.0.1:50051", f"127.0.0.1:{port}")

        def check() -> int:
            return subprocess.run([sys.executable, "-c", code, test[4]], timeout=60,
                                  capture_output=True).returncode

        servicer.set(test[4], health_pb2.HealthCheckResponse.SERVING)
        assert check() == 0
        servicer.set(test[4], health_pb2.HealthCheckResponse.NOT_SERVING)  # draining
        assert check() == 1
    finally:
        server.stop(None)


def test_ray_cluster_config() -> None:
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(config)  # Ray's own schema for cluster configs
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["pdserve_router"] >= 1
    by_resource = {r: name for name, t in types.items() for r in t["resources"]}
    prefill, decode = types[by_resource["pdserve_prefill"]], types[by_resource["pdserve_decode"]]
    assert by_resource["pdserve_prefill"] != by_resource["pdserve_decode"]
    for node_type, role in ((prefill, "prefill"), (decode, "decode")):
        # One worker per GPU, each requesting one pdserve_<role>.
        assert node_type["resources"][f"pdserve_{role}"] == node_type["resources"]["GPU"]
        assert any(r.startswith("accelerator_type:") for r in node_type["resources"])
    assert "--entrypoint=" in config["docker"]["run_options"]
    assert "pdserve up --ray-address auto" in (DEPLOY / "ray-cluster.yaml").read_text()


def defined_metrics() -> set[str]:
    """The Prometheus series pdserve's code defines (prometheus_client adds _total to
    counters and _bucket/_sum/_count to histograms)."""
    series = set()
    for path in (ROOT / "services").rglob("*.py"):
        for kind, name in re.findall(r"\b(Counter|Gauge|Histogram)\(\s*\"(pdserve_\w+)\"",
                                     path.read_text()):
            if kind == "Counter":
                series.add(f"{name}_total")
            elif kind == "Histogram":
                series |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            else:
                series.add(name)
    return series


def test_grafana_dashboard() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "pdserve-dashboard.json").read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels
               for t in p.get("targets", []))
    used = {m for e in exprs for m in re.findall(r"\b((?:pdserve_|vllm:)[\w:]+)", e)}
    required = {
        "pdserve_router_inflight", "pdserve_router_pair_choices_total",
        "pdserve_router_rejections_total", "pdserve_router_disaggregation_decisions_total",
        "pdserve_router_time_to_first_token_seconds_bucket",
        "pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_seconds_bucket",
        "pdserve_kv_transfer_failures_total",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    }
    assert required <= used, required - used
    assert {m for m in used if m.startswith("pdserve_")} <= defined_metrics()
    # vLLM's names: defined by the installed vLLM.
    spec = importlib.util.find_spec("vllm")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        pytest.skip("vLLM is not installed: its metric names cannot be checked")
    source = "\n".join(p.read_text(errors="ignore") for p in Path(locations[0]).rglob("*.py")
                       if "metrics" in p.as_posix())
    for metric in {m for m in used if m.startswith("vllm:")}:
        base = re.sub(r"_(bucket|sum|count)$", "", metric)
        assert f'"{base}"' in source, f"{base} is not a metric of the installed vLLM"
    # The autoscalers' default metrics are ones the dashboard shows.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for role in ROLES:
        assert values[role]["autoscaling"]["metric"] in used
