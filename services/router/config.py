"""Router settings. Env prefix PDSERVE_."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.settings import ADVANCED


class RouterConfig(BaseSettings):
    """How the router finds workers, routes and admits. Env prefix PDSERVE_."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    redis_url: str = Field("", description="Redis holding the cluster state, e.g. "
                           "redis://host:6379/0 (required for the router and pool workers)")
    router_model: str = Field("", description="router: model folder for the tokenizer and chat "
                              "template; empty = the prepared default model")
    router_models: str = Field(
        "", description="router: every model the router serves, as NAME=FOLDER (the name "
        "its workers register, the folder of its tokenizer and chat template), several "
        "separated by commas; the first is the default model (requests without `model`). "
        "Empty: one model, router_model's, under the name its workers register. `pdserve "
        "up` sets it from its models")
    policy: Literal["load", "round_robin"] = Field(
        "load", description="router: pair choice: load (queued prompt tokens, KV usage, prefix "
        "cache, transfer cost) or round_robin (baseline)")
    local_prefill_max_tokens: int = Field(
        0, ge=0, description="router: prompts up to this many tokens, or any prompt while the "
        "prefill pool is saturated, prefill on the decode worker (0 = always disaggregate)")
    prefill_max_queued_tokens: int = Field(
        131072, ge=0, description="router: the prefill pool's bound: while the chosen "
        "prefill worker has this many prompt tokens queued, new requests get "
        "RESOURCE_EXHAUSTED (0 = no bound)", json_schema_extra=ADVANCED)
    max_inflight: int = Field(256, ge=1, description="router: requests in flight before new "
                              "ones get RESOURCE_EXHAUSTED")
    client_max_inflight: int = Field(
        0, ge=0, description="router: requests in flight per client (x-client-id metadata), "
        "counted across routers in Redis (0 = no limit)")
    retry_after_ms: int = Field(500, ge=1, description="router: retry hint sent with "
                                "RESOURCE_EXHAUSTED", json_schema_extra=ADVANCED)
    migration_limit: int = Field(
        3, ge=0, description="router: times a request may move to another worker when the "
        "one serving it fails (before or after its first token); 0 = fail the request",
        json_schema_extra=ADVANCED)
    # A hang costs silence + probe before the stream moves. Silence only triggers a
    # probe, so it can be short; the probe's timeout must cover a live worker whose
    # process is starved by its engine on a busy core (BENCHMARKS.md, "Handoff stall",
    # measures where a shorter one starts taking live workers for hung).
    stream_silence_s: float = Field(
        0.5, gt=0, description="router: a worker silent this long in a request is probed "
        "for liveness; one that does not answer is treated as failed (a hang)",
        json_schema_extra=ADVANCED)
    probe_timeout_s: float = Field(1.0, gt=0, description="router: longest wait for a "
                                   "liveness probe's answer", json_schema_extra=ADVANCED)
    refresh_s: float = Field(0.5, gt=0, description="router: how often the worker view is "
                             "re-read from Redis", json_schema_extra=ADVANCED)
    prefix_block_size: int = Field(128, ge=1, description="router: block size of prefix "
                                   "hashing (best: the engines' KV block size)",
                                   json_schema_extra=ADVANCED)
    transfer_token_weight: float = Field(
        0.1, ge=0, description="router: cost of taking one prompt token's KV into a decode "
        "worker's cache, in prefilled prompt tokens; tokens the decode worker caches already "
        "(known from its KV events) cost nothing, so pairs whose decode worker holds the "
        "prompt's prefix are preferred", json_schema_extra=ADVANCED)
    client_lease_s: float = Field(
        15.0, gt=0, description="router: TTL of a per-client slot in Redis, renewed every "
        "third of it while its request runs; a crashed router's slots come back after it",
        json_schema_extra=ADVANCED)


def model_folders(spec: str) -> list[tuple[str, str]]:
    """`router_models` as (name, folder) pairs, in order; ValueError naming a bad entry."""
    out: list[tuple[str, str]] = []
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, sep, folder = entry.partition("=")
        name, folder = name.strip(), folder.strip()
        if not sep or not name or not folder:
            raise ValueError(f"router_models: {entry!r} is not NAME=FOLDER (for example "
                             "--router-models smol=/models/smol,llama=/models/llama)")
        if any(n == name for n, _ in out):
            raise ValueError(f"router_models: the model name {name!r} is given twice")
        out.append((name, folder))
    return out
