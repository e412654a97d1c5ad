"""The settings blocks of the Helm chart's values.schema.json, derived from pdserve's
settings models, so that the chart accepts exactly the settings pdserve has.

    .venv/bin/python deploy/chart_schema.py          # rewrite them in the schema
    .venv/bin/python deploy/chart_schema.py --check  # exit 1 when the schema is stale

Each settings block of the chart (`server`, `engine`, `worker`, `router.settings`,
`kuberay.launcher`, and the per-role overrides) takes field names as keys; the chart
turns each into PDSERVE_<FIELD>. `config.<role>` is a whole settings file
(`settingsFile`: its sections and their keys, services/config_sections.py) that the
chart mounts for `pdserve <role> --config`. The fields the chart sets itself (hosts,
ports, model path, Redis URL, pool sizes, credentials) are left out of both, so values
cannot contradict the manifests.
tests/unit/test_helm_chart.py fails when this output and the schema differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "helm" / "pdserve" / "values.schema.json"

# Fields the chart derives from its own values (see templates/configmap.yaml).
MANAGED: dict[str, frozenset[str]] = {
    # and the security files, mounted from the chart's Secrets (values.security).
    "ServerConfig": frozenset({"host", "port", "metrics_port", "http_port", "health_port",
                               "api_keys_file", "tls_cert_file", "tls_key_file",
                               "tls_client_ca_file", "allow_insecure",
                               "internal_tls_ca_file", "internal_tls_cert_file",
                               "internal_tls_key_file"}),
    # tensor_parallel_size: per role, from prefill/decode.tensorParallelSize (GPU count).
    "EngineConfig": frozenset({"model", "tensor_parallel_size"}),
    "WorkerConfig": frozenset({"worker_id", "redis_url", "advertise_host", "kv_host",
                               "kv_advertise_host", "kv_port"}),
    # router_models: a release deploys one model (docs/kubernetes.md, "One model per
    # release").
    "RouterConfig": frozenset({"redis_url", "router_model", "router_models"}),
    # stack_tls: the chart mounts certificates, `pdserve up` makes none.
    "LauncherConfig": frozenset({"prefill", "decode", "ray_address", "stack_tls",
                                 "prefill_tp", "decode_tp", "models"}),
    # the cluster secret's file, mounted from the chart's Secret (values.security).
    "ClusterStateConfig": frozenset({"cluster_secret", "cluster_secret_file",
                                     "allow_unsigned_records"}),
}
# Settings file sections with nothing a pod may set (`local`: `serve --mode disagg`).
FILE_SECTIONS_LEFT_OUT = frozenset({"local", "cluster"})

# values.schema.json definition name -> settings model.
DEFINITIONS = {
    "serverSettings": "ServerConfig",
    "engineSettings": "EngineConfig",
    "workerSettings": "WorkerConfig",
    "routerSettings": "RouterConfig",
    "launcherSettings": "LauncherConfig",
}


def models() -> dict[str, Any]:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from services.config_doc import settings_models

    return {m.__name__: m for m in settings_models()}


def settings_definition(model: Any) -> dict[str, Any]:
    """A JSON schema (draft-07) object for the user-settable fields of `model`."""
    fields = model.model_json_schema()["properties"]
    managed = MANAGED[model.__name__]
    properties: dict[str, Any] = {}
    for name in model.model_fields:
        if name in managed:
            continue
        prop = {k: v for k, v in fields[name].items() if k not in ("title", "advanced")}
        properties[name] = dict(sorted(prop.items()))
    return {
        "type": "object",
        "description": f"{model.__name__} fields, each set as PDSERVE_<FIELD>; the chart "
                       f"sets {', '.join(sorted(managed))} itself",
        "additionalProperties": False,
        "properties": properties,
    }


def settings_file_definition() -> dict[str, Any]:
    """A settings file's schema: its sections, each taking its model's fields."""
    from services.config_sections import section_models

    properties = {}
    for section, model in section_models().items():
        if section in FILE_SECTIONS_LEFT_OUT:
            continue
        definition = settings_definition(model)
        definition["description"] = (
            f"`{section}:` {model.__name__} fields; the chart sets "
            f"{', '.join(sorted(MANAGED[model.__name__]))} itself")
        properties[section] = definition
    return {
        "type": "object",
        "description": "a pdserve settings file (docs/configuration.md); the chart's own "
                       "PDSERVE_* variables win over it",
        "additionalProperties": False,
        "properties": properties,
    }


def settings_definitions() -> dict[str, dict[str, Any]]:
    by_name = models()
    definitions = {key: settings_definition(by_name[model])
                   for key, model in DEFINITIONS.items()}
    definitions["settingsFile"] = settings_file_definition()
    return definitions


def main(argv: list[str]) -> int:
    schema = json.loads(SCHEMA.read_text())
    wanted = settings_definitions()
    current = {k: schema["definitions"].get(k) for k in wanted}
    if "--check" in argv:
        if current != wanted:
            print(f"{SCHEMA.relative_to(ROOT)} is stale: run python deploy/chart_schema.py",
                  file=sys.stderr)
            return 1
        return 0
    schema["definitions"].update(wanted)
    SCHEMA.write_text(json.dumps(schema, indent=2) + "\n")
    print(f"wrote {SCHEMA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
