"""The Helm chart's security (helm/pdserve, rendered by the real Helm engine as in
test_helm_chart.py): generated credentials that pdserve's own loaders accept (the
internal certificates complete a real mTLS handshake), Secrets mounted read-only and
never copied into ConfigMaps, NetworkPolicy egress per role, ingress by namespace and
CIDR, cert-manager Certificates, the Ray dashboard kept off the network, and insecure
combinations refused.
"""

from __future__ import annotations

import base64
import ipaddress
import json
from pathlib import Path
from typing import Any

import pytest

from services.security.apikeys import parse_file_text
from services.security.tls import INTERNAL_NAME, TLSFiles, load
from tests.integration.test_helm_chart import (
    ELSEWHERE,
    FULLNAME,
    NAMESPACE,
    ROLES,
    STRANGER,
    HelmFailure,
    _selects,
    config_maps,
    endpoints,
    find,
    ingress_allowed,
    needs_helm,
    pod,
    pod_specs,
    render,
    rendered,
)

SECRETS_DIR = "/etc/pdserve/secrets"


def secret_data(objects: Any, name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in find(objects, "Secret", name)["data"].items()}


def secrets_volume(spec: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """path in the secrets volume -> (Secret, key)."""
    (volume,) = [v for v in spec["volumes"] if v["name"] == "pdserve-secrets"]
    return {item["path"]: (source["secret"]["name"], item["key"])
            for source in volume["projected"]["sources"] for item in source["secret"]["items"]}


def write_role_files(objects: Any, spec: dict[str, Any], into: Path) -> Path:
    """The files the kubelet would project into a pod's secrets volume."""
    for path, (secret, key) in secrets_volume(spec).items():
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(secret_data(objects, secret)[key])
        target.chmod(0o440)
    return into


# ======================================================================================
# Generated credentials work with pdserve's own loaders.
# ======================================================================================
@needs_helm
def test_generated_api_keys_parse_and_reach_only_the_router() -> None:
    objects = rendered("default")
    keys = parse_file_text(secret_data(objects, f"{FULLNAME}-api-keys")["api-keys"].decode(),
                           "Secret")
    assert [k.client for k in keys] == ["default"]
    router = pod(objects, "router")
    assert secrets_volume(router.get("spec", router))["api-keys"] == (
        f"{FULLNAME}-api-keys", "api-keys")
    assert config_maps(objects)[f"{FULLNAME}-router"]["PDSERVE_API_KEYS_FILE"] == (
        f"{SECRETS_DIR}/api-keys")
    for role in ("prefill", "decode"):
        assert "api-keys" not in secrets_volume(pod(objects, role))
        assert "PDSERVE_API_KEYS_FILE" not in config_maps(objects)[f"{FULLNAME}-{role}"]
    two = render({"security": {"apiKeys": {"clients": ["web", "batch"]}}})
    text = secret_data(two, f"{FULLNAME}-api-keys")["api-keys"].decode()
    assert [k.client for k in parse_file_text(text, "Secret")] == ["web", "batch"]


@needs_helm
async def test_generated_internal_certificates_complete_an_mtls_handshake(
        tmp_path: Path) -> None:
    import grpc
    from cryptography import x509
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from services.server.channels import dial, grpc_options
    from services.server.ports import add_internal_port

    objects = rendered("default")
    files = {}
    for role in ROLES:
        root = write_role_files(objects, pod(objects, role), tmp_path / role)
        files[role] = TLSFiles.of(root / "internal/ca.crt", root / "internal/tls.crt",
                                  root / "internal/tls.key")
        load(files[role], need_ca=True, need_cert=True)  # parses; the key is the cert's
        cert = x509.load_pem_x509_certificate((root / "internal/tls.crt").read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert INTERNAL_NAME in names.get_values_for_type(x509.DNSName)
        data = config_maps(objects)[f"{FULLNAME}-{role}"]
        assert data["PDSERVE_INTERNAL_TLS_CERT_FILE"] == f"{SECRETS_DIR}/internal/tls.crt"
    # The router's certificate opens the decode worker's port (and a plaintext peer not).
    server = grpc.aio.server(options=grpc_options())
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = add_internal_port(server, "127.0.0.1:0", files["decode"])
    await server.start()
    try:
        async with dial(f"127.0.0.1:{port}", files["router"]) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(plain).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        await server.stop(None)


@needs_helm
def test_redis_gets_a_generated_password() -> None:
    objects = rendered("default")
    password = secret_data(objects, f"{FULLNAME}-redis")["redis-password"].decode()
    assert len(password) >= 32 and password.isalnum()  # URL-safe
    redis = find(objects, "StatefulSet", f"{FULLNAME}-redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--requirepass") + 1] == (
        "$(REDIS_PASSWORD)")
    refs = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in container["env"]}
    assert refs["REDIS_PASSWORD"] == refs["REDISCLI_AUTH"] == {
        "name": f"{FULLNAME}-redis", "key": "redis-password"}
    for role in ROLES:
        env = {v["name"]: v for v in pod(objects, role)["containers"][0]["env"]}
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULLNAME}-redis"
        assert env["PDSERVE_REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@")


@needs_helm
@pytest.mark.parametrize("scenario", ["default", "tls", "kuberay", "external-redis"])
def test_secrets_are_mounted_read_only_and_never_copied(scenario: str) -> None:
    objects = rendered(scenario)
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    values = [base64.b64decode(v) for s in secrets.values() for v in s["data"].values()]
    text = json.dumps([o for o in objects if o["kind"] != "Secret"])
    for value in values:  # no generated secret appears outside its Secret
        for line in value.decode().splitlines():
            if len(line) >= 16 and "CERTIFICATE" not in line:
                assert line not in text
    for where, template in pod_specs(objects):
        spec = template["spec"]
        if where.startswith("StatefulSet"):
            continue  # Redis: its password through secretKeyRef only
        (volume,) = [v for v in spec["volumes"] if v["name"] == "pdserve-secrets"]
        assert volume["projected"]["defaultMode"] == 0o440, where
        for container in spec["containers"]:
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == "pdserve-secrets"]
            assert mount["readOnly"] is True and mount["mountPath"] == SECRETS_DIR, where
            for var in container.get("env", []):
                assert "value" in var or "secretKeyRef" in var["valueFrom"] or (
                    "fieldRef" in var["valueFrom"]), where
        assert "cluster-secret" in secrets_volume(spec), where
    for data in config_maps(objects).values():
        for key, value in data.items():
            if key.endswith("_FILE"):
                assert value.startswith(SECRETS_DIR + "/"), key


# ======================================================================================
# TLS from cert-manager and from your Secrets.
# ======================================================================================
@needs_helm
def test_cert_manager_certificates() -> None:
    objects = rendered("tls")
    certificates = {o["metadata"]["name"]: o["spec"] for o in objects
                    if o["kind"] == "Certificate"}
    public = certificates[f"{FULLNAME}-public-tls"]
    assert public["dnsNames"] == ["llm.example.com"]
    assert public["issuerRef"]["name"] == "letsencrypt"
    assert public["privateKey"]["rotationPolicy"] == "Always"
    # The internal CA is bootstrapped for this release: self-signed -> CA -> roles.
    issuers = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Issuer"}
    assert "selfSigned" in issuers[f"{FULLNAME}-selfsigned"]
    ca = certificates[f"{FULLNAME}-internal-ca"]
    assert ca["isCA"] and ca["issuerRef"]["name"] == f"{FULLNAME}-selfsigned"
    assert issuers[f"{FULLNAME}-internal-ca"]["ca"]["secretName"] == ca["secretName"]
    for role in ROLES:
        cert = certificates[f"{FULLNAME}-{role}-tls"]
        assert INTERNAL_NAME in cert["dnsNames"]
        assert {"server auth", "client auth"} <= set(cert["usages"])
        assert cert["issuerRef"]["name"] == f"{FULLNAME}-internal-ca"
        assert secrets_volume(pod(objects, role))["internal/tls.crt"] == (
            cert["secretName"], "tls.crt")
    router = secrets_volume(pod(objects, "router"))
    assert router["public/tls.key"] == (f"{FULLNAME}-public-tls", "tls.key")
    assert router["public/client-ca.crt"] == ("pdserve-client-ca", "ca.crt")
    assert router["api-keys"] == ("pdserve-api-keys", "api-keys")
    data = config_maps(objects)[f"{FULLNAME}-router"]
    assert data["PDSERVE_TLS_CLIENT_CA_FILE"] == f"{SECRETS_DIR}/public/client-ca.crt"
    assert "PDSERVE_TLS_CERT_FILE" not in config_maps(objects)[f"{FULLNAME}-decode"]
    # No generated Secrets where cert-manager or yours provide them.
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    assert names == {f"{FULLNAME}-redis", f"{FULLNAME}-cluster-secret"}


@needs_helm
def test_your_issuer_and_your_secrets() -> None:
    issuer = render({"security": {"internalTLS": {"source": "certManager", "certManager": {
        "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}}})
    assert not [o for o in issuer if o["kind"] == "Issuer"]
    for o in issuer:
        if o["kind"] == "Certificate":
            assert o["spec"]["issuerRef"]["name"] == "corp-ca"
    mine = render({"security": {"internalTLS": {"source": "existingSecret",
                                                "existingSecret": "my-certs"}}})
    for role in ROLES:
        assert secrets_volume(pod(mine, role))["internal/tls.key"] == ("my-certs", f"{role}.key")
    assert f"{FULLNAME}-internal-tls" not in {o["metadata"]["name"] for o in mine}


# ======================================================================================
# NetworkPolicy egress, and ingress by namespace and CIDR.
# ======================================================================================
DNS = {"labels": {"k8s-app": "kube-dns"}, "namespace": "kube-system", "ip": "10.96.0.10",
       "ports": {}}
INTERNET = {"labels": {}, "namespace": "", "ip": "203.0.113.5", "ports": {}}


def _peer_matches(peer: dict[str, Any], target: dict[str, Any], own_namespace: str) -> bool:
    if "ipBlock" in peer:
        return ipaddress.ip_address(target["ip"]) in ipaddress.ip_network(peer["ipBlock"]["cidr"])
    if not target["namespace"]:
        return False  # outside the cluster: only ipBlocks match
    if "namespaceSelector" in peer:
        ns_ok = _selects(peer["namespaceSelector"],
                         {"kubernetes.io/metadata.name": target["namespace"]})
    else:
        ns_ok = target["namespace"] == own_namespace
    return ns_ok and _selects(peer.get("podSelector", {}), target["labels"])


def egress_allowed(policies: list[dict[str, Any]], source: dict[str, Any], port: int,
                   target: dict[str, Any], protocol: str = "TCP") -> bool:
    """Kubernetes NetworkPolicy egress semantics for one connection from `source`."""
    selecting = [p for p in policies if p["metadata"]["namespace"] == source["namespace"]
                 and "Egress" in p["spec"].get("policyTypes", [])
                 and _selects(p["spec"]["podSelector"], source["labels"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("egress", []):
            ports = rule.get("ports")
            if ports and not any(p["port"] == port and p.get("protocol", "TCP") == protocol
                                 for p in ports):
                continue
            peers = rule.get("to")
            if not peers or any(_peer_matches(peer, target, policy["metadata"]["namespace"])
                                for peer in peers):
                return True
    return False


@needs_helm
@pytest.mark.parametrize("scenario", ["default", "hostpath"])
def test_egress_goes_only_where_each_role_talks(scenario: str) -> None:
    objects = rendered(scenario)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = endpoints(objects)
    router, prefill, decode, redis = (pods[c] for c in ("router", "prefill", "decode", "redis"))
    torch = scenario == "hostpath"

    def can(source: dict[str, Any], target: dict[str, Any], port: int | str) -> bool:
        number = target["ports"][port] if isinstance(port, str) else port
        return egress_allowed(policies, source, number, target)

    for source in (router, prefill, decode):
        assert egress_allowed(policies, source, 53, DNS, "UDP")
        assert can(source, redis, "redis")
        assert not can(source, INTERNET, 443) and not can(source, STRANGER, 80)
    assert can(router, prefill, "grpc") and can(router, decode, "grpc")
    assert not can(router, decode, "kv") and not can(router, INTERNET, 6379)
    assert can(prefill, decode, "kv")
    assert not can(prefill, router, "grpc")
    assert can(prefill, decode, 41234) is torch and can(decode, prefill, 41234) is torch
    assert not can(decode, router, "grpc")
    assert not can(redis, INTERNET, 443) and not can(redis, router, "grpc")


@needs_helm
def test_external_redis_egress() -> None:
    objects = render({"redis": {"enabled": False}, "externalRedis": {
        "url": "rediss://redis.example:6380/0", "existingSecret": "r"},
        "networkPolicy": {"egress": {"externalRedisCIDRs": ["192.0.2.0/24"]}}})
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    router = endpoints(objects)["router"]
    there = {**INTERNET, "ip": "192.0.2.7"}
    assert egress_allowed(policies, router, 6380, there)
    assert not egress_allowed(policies, router, 6380, INTERNET)
    assert not egress_allowed(policies, router, 6379, there)


@needs_helm
def test_extra_egress_and_router_cidrs() -> None:
    objects = rendered("tls")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = endpoints(objects)
    collector = {"labels": {}, "namespace": "observability", "ip": "10.3.3.3", "ports": {}}
    for role in ROLES:
        assert egress_allowed(policies, pods[role], 4317, collector)
        assert not egress_allowed(policies, pods[role], 4318, collector)
    router = pods["router"]
    assert ingress_allowed(policies, router, router["ports"]["grpc"], STRANGER)  # 10.9.9.9
    assert not ingress_allowed(policies, router, router["ports"]["grpc"], ELSEWHERE)


@needs_helm
def test_kuberay_egress_and_dashboard() -> None:
    objects = rendered("kuberay")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = endpoints(objects)
    head, decode = pods["ray-head"], pods["ray-decode"]
    assert egress_allowed(policies, decode, 6379, head)  # Ray's ports, between Ray pods
    assert egress_allowed(policies, decode, 6379, pods["redis"])
    assert not egress_allowed(policies, decode, 443, INTERNET)
    assert egress_allowed(policies, head, 443, INTERNET)  # in-tree autoscaler: the API
    cluster = find(objects, "RayCluster", FULLNAME)
    params = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert params["dashboard-host"] == "127.0.0.1" and params["include-dashboard"] == "true"
    head_ports = {p["name"] for p in cluster["spec"]["headGroupSpec"]["template"]["spec"][
        "containers"][0]["ports"]}
    assert "dashboard" not in head_ports
    off = find(render({"kuberay": {"enabled": True, "dashboard": {"enabled": False}}}),
               "RayCluster", FULLNAME)["spec"]["headGroupSpec"]["rayStartParams"]
    assert off["include-dashboard"] == "false" and "dashboard-host" not in off


# ======================================================================================
# Insecure combinations: refused unless security.allowInsecure.
# ======================================================================================
INSECURE = [
    ({"security": {"apiKeys": {"enabled": False}}}, "neither apiKeys nor publicTLS"),
    ({"security": {"internalTLS": {"enabled": False}}}, "internalTLS.enabled=false"),
    ({"redis": {"auth": {"enabled": False}}}, "redis.auth.enabled=false"),
    ({"redis": {"enabled": False}, "externalRedis": {"url": "redis://r:6379/0"}},
     "externalRedis.existingSecret is empty"),
]


@needs_helm
@pytest.mark.parametrize(("values", "message"), INSECURE)
def test_insecure_values_need_allow_insecure(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmFailure) as failure:
        render(values)
    assert failure.value.kind == "HelmRenderError"
    assert message in str(failure.value) and "allowInsecure" in str(failure.value)
    objects = render({**values, "security": {**values.get("security", {}),
                                             "allowInsecure": True}})
    assert config_maps(objects)[f"{FULLNAME}-router"]["PDSERVE_ALLOW_INSECURE"] == "true"


@needs_helm
@pytest.mark.parametrize(("values", "message"), [
    ({"security": {"publicTLS": {"enabled": True}}},
     "set exactly one of existingSecret and certManager.enabled"),
    ({"security": {"publicTLS": {"enabled": True, "certManager": {"enabled": True}}}},
     "issuerRef.name is required"),
    ({"security": {"publicTLS": {"enabled": True, "certManager": {
        "enabled": True, "issuerRef": {"name": "x"}}}}}, "dnsNames is required"),
    ({"security": {"internalTLS": {"source": "existingSecret"}}},
     "internalTLS.existingSecret is required"),
    ({"security": {"apiKeys": {"clients": []}}}, "name at least one client"),
    ({"kuberay": {"enabled": True, "head": {"rayStartParams": {"dashboard-host": "0.0.0.0"}}}},
     "set kuberay.dashboard instead"),
])
def test_incomplete_security_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmFailure) as failure:
        render(values)
    assert message in str(failure.value), str(failure.value)


@needs_helm
@pytest.mark.parametrize(("values", "message"), [
    ({"security": {"internalTLS": {"source": "vault"}}}, "/security/internalTLS/source"),
    ({"security": {"apiKeys": {"clients": ["no spaces"]}}}, "/security/apiKeys/clients/0"),
    ({"networkPolicy": {"router": {"cidrs": ["10.0.0.0"]}}}, "/networkPolicy/router/cidrs/0"),
    ({"networkPolicy": {"routerFrom": []}}, "additional properties 'routerFrom' not allowed"),
])
def test_schema_rejects_bad_security_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmFailure) as failure:
        render(values)
    assert failure.value.kind == "HelmValuesError"
    assert message in str(failure.value), str(failure.value)


@needs_helm
def test_notes_say_how_to_read_the_api_key() -> None:
    from tests.integration.test_helm_chart import render_files

    notes = render_files({})["pdserve/templates/NOTES.txt"]
    assert f"secret {FULLNAME}-api-keys" in notes and "--api-key" in notes
    assert NAMESPACE in notes
