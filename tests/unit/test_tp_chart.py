"""The chart's tensor-parallel values (prefill/decode.tensorParallelSize), rendered by the
real Helm engine (tests/integration/test_helm_chart.py runs it in a child process): each
role's engine gets its size, GPU pods one GPU per rank, and a layout the workers would
refuse at start is refused when the chart renders."""

from __future__ import annotations

from typing import Any

import pytest

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


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_tensor_parallel_kv_workers_are_refused_at_render(role: str) -> None:
    with pytest.raises(HelmFailure, match=f"{role}.tensorParallelSize 2: .*not supported yet"):
        render({role: {"tensorParallelSize": 2}})


def test_the_schema_refuses_a_size_below_one() -> None:
    with pytest.raises(HelmFailure):
        render({"prefill": {"tensorParallelSize": 0}})
