"""The KV layout fingerprint of an engine, read off its vLLM config."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from services.kv.fingerprint import LayoutFingerprint


def pdserve_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


def kv_packing(device_type: str) -> str:
    """How a (block, head) page is laid out. On CPU it depends on the instruction set
    (on AVX2, K is stored transposed); on GPU on the attention backend."""
    if device_type == "cpu":
        return f"cpu:{torch.backends.cpu.get_cpu_capability().lower()}"
    major, minor = torch.cuda.get_device_capability()
    return f"cuda:sm{major}{minor}"


def fingerprint_of(vllm_config: Any) -> LayoutFingerprint:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    dtype = cache.cache_dtype if cache.cache_dtype != "auto" else model.dtype
    return LayoutFingerprint(
        model=str(model.served_model_name or model.model),
        dtype=str(dtype).removeprefix("torch."),
        block_size=int(cache.block_size),
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_total_num_kv_heads()),
        head_size=int(model.get_head_size()),
        kv_packing=kv_packing(vllm_config.device_config.device_type),
        pdserve_version=pdserve_version(),
    )
