"""The configurations the planner compares, and a chosen one written out as `pdserve up`
flags and Helm values (the chart's keys: helm/pdserve/values.yaml)."""

from __future__ import annotations

from typing import Any

from services.plan.costmodel import Profile
from services.plan.fleet import FleetConfig, PoolSpec

DEFAULT_BUDGETS = (128, 256, 512)
DEFAULT_THRESHOLDS = (128, 256, 512, 1024)


def spread(values: list[int], at_most: int) -> list[int]:
    """At most `at_most` of the sorted `values`, evenly spaced, first and last kept."""
    if len(values) <= at_most:
        return values
    step = (len(values) - 1) / (at_most - 1)
    return sorted({values[round(i * step)] for i in range(at_most)})


def configurations(profile: Profile, units: int, budgets: tuple[int, ...] = DEFAULT_BUDGETS,
                   thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS, engine_units: int = 1,
                   max_splits: int = 8, transport: str = "grpc") -> list[FleetConfig]:
    """Colocated at the default and each tuned budget, every P:D split of ``units``
    (at most ``max_splits``, evenly spread), and conditional disaggregation at each
    threshold on one split.

    On CPU cores (one host) every configuration is one engine per role, because
    `pdserve up` pins all workers of a role to the same cores: colocated is one engine
    on every core, a P:D split is a prefill engine on P cores and a decode engine on the
    rest. On GPUs each engine has ``engine_units`` GPUs and the pools hold as many as fit.
    """
    if units < 1 or engine_units < 1:
        raise ValueError("units and engine_units must be >= 1")
    on_cores = profile.unit == "core"
    size = units if on_cores else engine_units
    count = 1 if on_cores else units // engine_units
    out = [FleetConfig("colocated_default", PoolSpec(count, size))]
    out += [FleetConfig(f"colocated_b{b}", PoolSpec(count, size, b)) for b in budgets]
    steps = units if on_cores else count
    splits = spread(list(range(1, steps)), max_splits)

    def pools(p: int) -> tuple[PoolSpec, PoolSpec]:
        if on_cores:
            return PoolSpec(1, units - p), PoolSpec(1, p)
        return PoolSpec(count - p, engine_units), PoolSpec(p, engine_units)

    for p in splits:
        decode, prefill = pools(p)
        out.append(FleetConfig(f"disagg_{p}p{steps - p}d", decode, prefill,
                               transport=transport))
    if splits:
        p = splits[0] if on_cores else max(1, splits[len(splits) // 3])
        decode, prefill = pools(p)
        for t in thresholds:
            out.append(FleetConfig(f"conditional_{p}p{steps - p}d_t{t}", decode, prefill,
                                   local_prefill_max_tokens=t, transport=transport))
    return out


def _cores(first: int, count: int) -> str:
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def up_flags(cfg: FleetConfig, profile: Profile) -> list[str]:
    """The `pdserve up` command line that runs ``cfg`` (colocated as decode workers that
    prefill their own prompts: no prefill pool)."""
    flags = ["pdserve", "up", "--prefill", str(cfg.prefill.engines if cfg.prefill else 0),
             "--decode", str(cfg.decode.engines)]
    # Both always: `pdserve up` bounds CPU engines' steps where they are not given, and
    # 0 (vLLM's budget, no per-prompt cap) is a choice the prediction was made for.
    flags += ["--max-num-batched-tokens", str(cfg.decode.max_num_batched_tokens),
              "--long-prefill-token-threshold", str(cfg.decode.long_prefill_token_threshold)]
    if cfg.local_prefill_max_tokens:
        flags += ["--local-prefill-max-tokens", str(cfg.local_prefill_max_tokens)]
    if cfg.prefill:
        flags += ["--kv-transport", cfg.transport]
    if profile.unit == "core":
        p_units = cfg.prefill.units if cfg.prefill else 0
        if cfg.prefill:
            flags += ["--prefill-cores", _cores(0, p_units)]
        flags += ["--decode-cores", _cores(p_units, cfg.decode.units)]
    else:  # a GPU engine's units are its tensor-parallel ranks
        if cfg.prefill and cfg.prefill.units > 1:
            flags += ["--prefill-tp", str(cfg.prefill.units)]
        if cfg.decode.units > 1:
            flags += ["--decode-tp", str(cfg.decode.units)]
    return flags


def helm_values(cfg: FleetConfig, profile: Profile) -> dict[str, Any]:
    """The chart values that run ``cfg``."""
    values: dict[str, Any] = {
        "prefill": {"replicas": cfg.prefill.engines if cfg.prefill else 0},
        "decode": {"replicas": cfg.decode.engines},
    }
    engine = {k: v for k, v in (
        ("max_num_batched_tokens", cfg.decode.max_num_batched_tokens),
        ("long_prefill_token_threshold", cfg.decode.long_prefill_token_threshold)) if v}
    if engine:
        values["engine"] = engine
    if cfg.local_prefill_max_tokens:
        values["router"] = {"settings": {
            "local_prefill_max_tokens": cfg.local_prefill_max_tokens}}
    if cfg.prefill:
        values["worker"] = {"kv_transport": cfg.transport}
    if profile.unit == "core":
        for role, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            if pool is not None:
                values[role]["resources"] = {"requests": {"cpu": str(pool.units)}}
    else:
        for role, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            if pool is not None:
                values[role]["resources"] = {"limits": {"nvidia.com/gpu": pool.units}}
                if pool.units > 1:  # the chart wants one GPU per rank
                    values[role]["tensorParallelSize"] = pool.units
    return values


def to_yaml(value: Any, indent: int = 0) -> str:
    """A small YAML writer for nested dicts of scalars (no dependency for four lines)."""
    lines = []
    for key, item in value.items():
        if isinstance(item, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(to_yaml(item, indent + 2))
        else:
            text = f'"{item}"' if isinstance(item, str) else str(item)
            lines.append(" " * indent + f"{key}: {text}")
    return "\n".join(lines)
