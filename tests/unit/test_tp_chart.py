"""The chart's tensor-parallel values (prefill/decode.tensorParallelSize), rendered by the
real Helm engine (tests/integration/test_helm_chart.py runs it in a child process): each
role's engine gets its size, GPU pods one GPU per rank, a tensor-parallel decode pod one KV port
per rank, and a layout the workers would refuse at start is refused when the chart renders."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.helpers.doc_blocks import collect
from tests.integration.test_helm_chart import (
    FULLNAME,
    HelmFailure,
    config_maps,
    find,
    needs_helm,
    pod,
    render,
    scenario_values,
)

pytestmark = needs_helm


def gpu_limits(spec: dict[str, Any]) -> Any:
    return spec["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu")


def test_each_role_gets_its_tensor_parallel_size() -> None:
    cms = config_maps(render({}))
    for role in ("prefill", "decode"):
        assert cms[f"{FULLNAME}-{role}"]["PDSERVE_TENSOR_PARALLEL_SIZE"] == "1"
    assert "PDSERVE_TENSOR_PARALLEL_SIZE" not in cms[f"{FULLNAME}-router"]


def test_gpu_pods_get_one_gpu_per_rank_without_asking() -> None:
    values = scenario_values("gpu")
    for role in ("prefill", "decode"):
        del values[role]["resources"]["limits"]["nvidia.com/gpu"]
    objects = render(values)
    for role in ("prefill", "decode"):
        assert gpu_limits(pod(objects, role)) == 1
    # CPU images ask for no GPU
    assert gpu_limits(pod(render({}), "decode")) is None


def test_kuberay_groups_get_one_gpu_per_rank_of_each_actor() -> None:
    values = {**scenario_values("kuberay"), "image": {"flavor": "cuda"}}
    values["kuberay"] = {**values["kuberay"], "actorsPerPod": {"prefill": 2, "decode": 1}}
    objects = render(values)
    cluster = find(objects, "RayCluster", FULLNAME)
    groups = {g["groupName"]: g["template"]["spec"] for g in
              cluster["spec"]["workerGroupSpecs"]}
    assert gpu_limits(groups["prefill"]) == 2 and gpu_limits(groups["decode"]) == 1
    launcher = config_maps(objects)[f"{FULLNAME}-launcher"]
    assert launcher["PDSERVE_PREFILL_TP"] == launcher["PDSERVE_DECODE_TP"] == "1"


def test_a_gpu_count_that_is_not_one_per_rank_is_refused() -> None:
    values = scenario_values("gpu")
    values["decode"]["resources"]["limits"]["nvidia.com/gpu"] = 2
    with pytest.raises(HelmFailure, match="one GPU per tensor-parallel rank"):
        render(values)


def test_a_tensor_parallel_decode_pod_opens_a_kv_port_per_rank() -> None:
    # Each decode rank runs its own KV receiver on ports.kv + rank: the pod declares them
    # and the network policies let prefill pods reach all of them, and no other.
    objects = render({"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 2}})
    cms = config_maps(objects)
    for role in ("prefill", "decode"):
        assert cms[f"{FULLNAME}-{role}"]["PDSERVE_TENSOR_PARALLEL_SIZE"] == "2"
    container = pod(objects, "decode")["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["kv"] == 14579 and ports["kv-rank1"] == 14580
    kv_rules = [port for o in objects if o["kind"] == "NetworkPolicy"
                for rule in o["spec"].get("ingress", []) + o["spec"].get("egress", [])
                for port in rule.get("ports", []) if port.get("port") == 14579]
    assert kv_rules and all(p.get("endPort") == 14580 for p in kv_rules)
    one = render({})
    assert all("endPort" not in port for o in one if o["kind"] == "NetworkPolicy"
               for rule in o["spec"].get("ingress", []) + o["spec"].get("egress", [])
               for port in rule.get("ports", []))


def test_gpu_images_refuse_prefill_and_decode_of_different_sizes() -> None:
    values = scenario_values("gpu")
    for role in ("prefill", "decode"):
        del values[role]["resources"]["limits"]["nvidia.com/gpu"]
    render({**values, "prefill": {**values["prefill"], "tensorParallelSize": 2},
            "decode": {**values["decode"], "tensorParallelSize": 2}})
    with pytest.raises(HelmFailure, match="on GPU images prefill and decode need one size"):
        render({**values, "prefill": {**values["prefill"], "tensorParallelSize": 2}})


def test_the_heterogeneous_values_of_the_kubernetes_guide_render() -> None:
    (block,) = [b for b in collect()[0] if b.path == "docs/kubernetes.md" and b.lang == "yaml"
                and "tensorParallelSize: 2" in b.text]
    cms = config_maps(render(yaml.safe_load(block.text)))
    assert cms[f"{FULLNAME}-prefill"]["PDSERVE_TENSOR_PARALLEL_SIZE"] == "2"
    assert cms[f"{FULLNAME}-decode"]["PDSERVE_TENSOR_PARALLEL_SIZE"] == "1"


def test_a_port_among_the_decode_ranks_kv_ports_is_refused() -> None:
    with pytest.raises(HelmFailure, match=r"decode\.ports\.metrics .* among the KV ports"):
        render({"decode": {"tensorParallelSize": 2, "ports": {"kv": 9399}}})


def test_the_schema_refuses_a_size_below_one() -> None:
    with pytest.raises(HelmFailure):
        render({"prefill": {"tensorParallelSize": 0}})
