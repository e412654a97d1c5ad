"""Shapes: the tensor-parallel size of each role's workers and speculative decoding on the
decode side, priced from a model's architecture and a GPU's datasheet figures, so that
`pdserve plan predict --model` can rank (prefill at TP a x m, decode at TP b x n) fleets
on hardware nobody profiled, as NVIDIA's AIConfigurator ranks them for Dynamo.

A worker of TP t is one engine whose step cost (``costmodel.StepCost``) is derived, not
measured:

- weights and FLOPs split over the t ranks: a decode step reads ``weight_bytes / t`` per
  rank at the GPU's effective HBM bandwidth, and every token computes
  ``2 * matmul_params / t`` FLOPs per rank at the prefill utilisation (``mfu``) of the
  GPU's peak for the weights' dtype;
- attention work splits by heads: prefill attention pairs cost ``4 * hidden * layers /
  t`` FLOPs each, and a decoding sequence reads its rank's KV heads (``max(1, H / t)`` of
  the model's H KV heads, as vLLM shards them) per context token;
- two all-reduces per transformer layer (after attention and after the MLP, as in
  vLLM's Llama), each a ring over the t ranks: ``2 (t - 1)`` hops of the link's latency
  plus ``2 (t - 1) / t`` of the message (tokens x hidden x activation bytes) at the
  link's bandwidth (the ring's cost as nccl-tests' PERFORMANCE.md states it). Nothing
  at TP 1.

A shipped request's KV moves per rank: each decode rank receives its own heads, from one
prefill rank or, when the sizes differ, in pieces from several (``services.kv.tp_layout``
maps them); ranks move in parallel over their own NICs, so the transfer takes the busiest
rank's bytes at one NIC's bandwidth plus one latency per piece it handles.

A shape is feasible when the weights' share and the KV of ``min_batch`` sequences of the
workload's longest request fit one rank's memory (vLLM's ``gpu_memory_utilization`` of
it, less a reserve for activations and CUDA graphs); what is left is the engine's KV
cache. Infeasible shapes are reported with their reason, never simulated.

Speculative decoding (``SpecDecode``) on the decode workers: a step verifies
``draft_tokens + 1`` tokens per sequence, costs ``draft_cost`` more for the drafter and
emits ``tokens_per_step`` tokens on average (the acceptance the user assumes). The
simulation keeps one token per step, so a decode step's cost is spread over the tokens
it emits: ITL and TPOT are per token, as TPOT is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.kv.tp_layout import kv_heads_per_rank, kv_pieces, receives_of, sends_of, tp_problem
from services.plan.costmodel import Profile, StepCost, Transport
from services.plan.fleet import FleetConfig, PoolSpec

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the cost of a TP shape depends on, for one model and weight format."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    matmul_params: float  # weights multiplied per token: every linear layer, lm_head included
    weight_bytes: float  # the weights in GPU memory, whole model
    weight_dtype: str = "bf16"  # "bf16" or "fp8": which peak the GEMMs run at
    kv_bytes: int = 2  # bytes per KV element (a BF16 KV cache)
    act_bytes: int = 2  # bytes per activation element an all-reduce moves
    sources: tuple[str, ...] = ()

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer and KV head, one token, whole model."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

    def kv_bytes_per_token_rank(self, tp: int) -> int:
        """K and V of one token in one rank's cache at TP ``tp``."""
        return 2 * self.layers * kv_heads_per_rank(tp, self.kv_heads) * self.head_dim \
            * self.kv_bytes


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU kind: datasheet figures, the links between GPUs, and the utilisations the
    cost model assumes (each stated with its source in ``sources``)."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense tensor-core peak
    fp8_flops: float
    link_bytes_per_s: float  # NVLink, one direction, per GPU
    link_latency_s: float  # one hop of a ring all-reduce
    rdma_bytes_per_s: float  # the GPU's own NIC, for KV between workers
    rdma_latency_s: float  # per KV piece
    node_gpus: int = 8  # GPUs one NVLink domain joins: the largest TP modelled
    mfu: float = 0.5  # prefill share of the compute peak
    bandwidth_util: float = 0.74  # decode share of the HBM bandwidth
    memory_utilization: float = 0.9  # vLLM's gpu_memory_utilization
    reserve_bytes: float = 4 * GiB  # activations and CUDA graphs, per rank
    sources: tuple[str, ...] = ()

    def peak_flops(self, dtype: str) -> float:
        return self.fp8_flops if dtype == "fp8" else self.bf16_flops


LLAMA_70B_SOURCE = ("Llama-3.3-70B-Instruct config.json (huggingface.co/meta-llama/"
                    "Llama-3.3-70B-Instruct): 80 layers, hidden 8192, intermediate 28672, "
                    "64 attention heads, 8 KV heads, head_dim 128, vocabulary 128256, "
                    "untied embeddings: 68.45e9 linear-layer parameters per token plus "
                    "1.05e9 each for the embedding and lm_head (70.55e9 in all)")
MODELS: dict[str, ModelSpec] = {
    "llama-3.3-70b": ModelSpec(
        "Llama-3.3-70B-Instruct (BF16)", 80, 8192, 64, 8, 128, 69.5e9, 70.55e9 * 2,
        sources=(LLAMA_70B_SOURCE,)),
    "llama-3.3-70b-fp8": ModelSpec(
        "Llama-3.3-70B-Instruct-FP8-dynamic", 80, 8192, 64, 8, 128, 69.5e9,
        68.45e9 * 1 + 2.1e9 * 2, weight_dtype="fp8",
        sources=(LLAMA_70B_SOURCE, "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic (the model "
                 "of the Dynamo and llm-d recipes): linear layers in FP8, embedding and "
                 "lm_head left in BF16, KV cache in BF16")),
    "llama-3.1-8b": ModelSpec(
        "Llama-3.1-8B-Instruct (BF16)", 32, 4096, 32, 8, 128, 7.5e9, 8.03e9 * 2,
        sources=("meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, "
                 "intermediate 14336, 32 heads, 8 KV heads, 8.03e9 parameters",)),
}

_NVLINK = ("NVLink 4: 900 GB/s per GPU counting both directions, so 450 GB/s each way "
           "(NVIDIA H100 and H200 datasheets, nvidia.com/en-us/data-center/h100, /h200)")
_HOP = ("ASSUMPTION: 1 us per ring hop (an NVLink/NVSwitch hop plus its share of the "
        "kernel), so a TP-8 all-reduce of a decode step's activations takes ~14 us")
_NIC = ("KV between workers over each GPU's own 400 Gb/s ConnectX-7 NIC (DGX H100/H200: "
        "one per GPU), 50 GB/s; 0.5 ms per piece (the shipped 8B profile's RDMA figure)")
_UTIL = ("ASSUMPTION: prefill at 50% of the tensor-core peak (as the shipped "
         "llama-3.1-8b-h100 profile); decode at 74% of HBM bandwidth (what that profile's "
         "measured batch-1 step achieves on the weights); 4 GiB reserve per rank")
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 SXM5 80GB", 80 * GiB, 3.35e12, 989e12, 1979e12, 450e9, 1e-6,
                    50e9, 5e-4,
                    sources=("H100 SXM5: 80 GB HBM3 at 3.35 TB/s, 989 TFLOPS dense BF16, "
                             "1979 dense FP8 (NVIDIA H100 datasheet)", _NVLINK, _HOP, _NIC,
                             _UTIL)),
    "h200": GpuSpec("NVIDIA H200 SXM 141GB", 141e9, 4.8e12, 989e12, 1979e12, 450e9, 1e-6,
                    50e9, 5e-4,
                    sources=("H200 SXM: 141 GB HBM3e at 4.8 TB/s, the H100's compute "
                             "(NVIDIA H200 datasheet)", _NVLINK, _HOP, _NIC, _UTIL)),
}


def allreduce_s(tp: int, nbytes: float, gpu: GpuSpec) -> float:
    """One ring all-reduce of ``nbytes`` over ``tp`` ranks (0 at TP 1)."""
    if tp <= 1:
        return 0.0
    return 2 * (tp - 1) * gpu.link_latency_s + 2 * (tp - 1) / tp * nbytes / gpu.link_bytes_per_s


def step_cost(model: ModelSpec, gpu: GpuSpec, tp: int) -> StepCost:
    """The step cost of one engine of TP ``tp`` (module doc)."""
    peak = gpu.peak_flops(model.weight_dtype) * gpu.mfu * tp
    bandwidth = gpu.hbm_bytes_per_s * gpu.bandwidth_util
    per_layer = 2 * model.layers  # all-reduces per step
    ar_fixed = per_layer * allreduce_s(tp, 0.0, gpu)
    ar_token = per_layer * (allreduce_s(tp, model.hidden * model.act_bytes, gpu)
                            - allreduce_s(tp, 0.0, gpu))
    token = 2 * model.matmul_params / peak + ar_token
    return StepCost(
        base_s=model.weight_bytes / tp / bandwidth + ar_fixed,
        prefill_token_s=token,
        decode_seq_s=token,
        attention_s=4 * model.hidden * model.layers * 1e6 / (gpu.bf16_flops * gpu.mfu * tp),
        decode_context_s=model.kv_bytes_per_token_rank(tp) * 1e6 / bandwidth)


def allreduce_share(model: ModelSpec, gpu: GpuSpec, tp: int, tokens: int) -> float:
    """Seconds of a step of ``tokens`` tokens spent in all-reduces (for reports)."""
    return 2 * model.layers * allreduce_s(tp, tokens * model.hidden * model.act_bytes, gpu)


@dataclass(frozen=True, slots=True)
class Fit:
    """Whether one engine of TP ``tp`` fits, and what KV cache it keeps."""

    tp: int
    reason: str  # "" when it fits
    weight_bytes_rank: float
    kv_tokens: int

    @property
    def ok(self) -> bool:
        return not self.reason


def fit(model: ModelSpec, gpu: GpuSpec, tp: int, longest: int, batch: int = 1) -> Fit:
    """Whether ``tp`` ranks hold the weights and ``batch`` sequences of ``longest`` tokens."""
    problem = tp_problem(tp, model.heads, "attention heads") or tp_problem(tp, model.kv_heads)
    weights = model.weight_bytes / max(tp, 1)
    if problem:
        return Fit(tp, problem, weights, 0)
    if tp > gpu.node_gpus:
        return Fit(tp, f"TP {tp} spans nodes: one NVLink domain joins {gpu.node_gpus} "
                   f"{gpu.name} GPUs, and the model prices all-reduces over NVLink only",
                   weights, 0)
    usable = gpu.memory_bytes * gpu.memory_utilization - gpu.reserve_bytes
    if weights >= usable:
        return Fit(tp, f"weights need {weights / GiB:.1f} GiB per rank at TP {tp}, "
                   f"{usable / GiB:.1f} GiB usable of {gpu.memory_bytes / GiB:.0f} GiB "
                   f"({gpu.memory_utilization:.0%} less {gpu.reserve_bytes / GiB:.0f} GiB "
                   "reserve): use a larger TP", weights, 0)
    per_token = model.kv_bytes_per_token_rank(tp)
    tokens = int((usable - weights) // per_token)
    if tokens < longest * batch:
        need = longest * batch * per_token
        return Fit(tp, f"KV of {batch} sequence(s) of {longest} tokens needs "
                   f"{need / GiB:.1f} GiB per rank at TP {tp}, {(usable - weights) / GiB:.1f} "
                   "GiB left after the weights: use a larger TP", weights, tokens)
    return Fit(tp, "", weights, tokens)


def kv_transfer_s(model: ModelSpec, gpu: GpuSpec, prefill_tp: int, decode_tp: int,
                  tokens: int) -> float:
    """Seconds to move ``tokens`` tokens of KV from a prefill worker of TP ``prefill_tp``
    to a decode worker of TP ``decode_tp``: every rank pair moves its pieces in parallel,
    the busiest rank sets the time (module doc)."""
    pieces = kv_pieces(prefill_tp, decode_tp, model.kv_heads)
    per_head = 2 * model.layers * model.head_dim * model.kv_bytes * tokens
    ends = [receives_of(d, pieces) for d in range(decode_tp)]
    ends += [sends_of(p, pieces) for p in range(prefill_tp)]
    heads = max(sum(p.dst.count for p in mine) for mine in ends)
    count = max(len(mine) for mine in ends)
    return count * gpu.rdma_latency_s + heads * per_head / gpu.rdma_bytes_per_s


@dataclass(frozen=True, slots=True)
class SpecDecode:
    """Speculative decoding on the decode workers, with the acceptance the user assumes:
    ``tokens_per_step`` tokens emitted per sequence per step on average (accepted drafts
    plus the one the target model always gives), ``draft_tokens`` verified per step,
    drafting at ``draft_cost`` of a step's fixed cost."""

    tokens_per_step: float = 2.0
    draft_tokens: int = 3
    draft_cost: float = 0.1

    def __post_init__(self) -> None:
        if self.draft_tokens < 1:
            raise ValueError("speculative decoding verifies at least one draft token")
        if not 1.0 <= self.tokens_per_step <= self.draft_tokens + 1:
            raise ValueError(f"tokens per step must be between 1 and draft tokens + 1 "
                             f"({self.draft_tokens + 1}), got {self.tokens_per_step}")
        if self.draft_cost < 0:
            raise ValueError("the draft cost must be >= 0")

    def cost(self, base: StepCost) -> StepCost:
        """A decode engine's step cost per emitted token (module doc): prefill terms as
        they were, the step's fixed cost and context reads spread over the tokens a step
        emits, each sequence verifying ``draft_tokens + 1`` tokens."""
        tau = self.tokens_per_step
        return StepCost(base.base_s * (1 + self.draft_cost) / tau, base.prefill_token_s,
                        base.decode_seq_s * (self.draft_tokens + 1) / tau, base.attention_s,
                        base.decode_context_s / tau, base.request_s)


@dataclass(frozen=True, slots=True)
class Shape:
    """One fleet's shape: ``prefill_n`` prefill workers of TP ``prefill_tp`` (none:
    colocated) and ``decode_n`` decode workers of TP ``decode_tp``, speculative or not."""

    decode_tp: int
    decode_n: int
    prefill_tp: int = 0
    prefill_n: int = 0
    spec: bool = False

    @property
    def gpus(self) -> int:
        return self.decode_tp * self.decode_n + self.prefill_tp * self.prefill_n

    @property
    def name(self) -> str:
        spec = "_spec" if self.spec else ""
        if not self.prefill_n:
            return f"colocated_tp{self.decode_tp}x{self.decode_n}{spec}"
        return (f"disagg_p{self.prefill_tp}x{self.prefill_n}_d{self.decode_tp}x"
                f"{self.decode_n}{spec}")

    def columns(self) -> dict[str, Any]:
        return {"prefill": f"TP{self.prefill_tp} x {self.prefill_n}" if self.prefill_n
                else "-", "decode": f"TP{self.decode_tp} x {self.decode_n}",
                "spec": "on" if self.spec else "off", "gpus": self.gpus}


def enumerate_shapes(gpus: int, prefill_tps: tuple[int, ...], decode_tps: tuple[int, ...],
                     spec_modes: tuple[bool, ...] = (False,)) -> list[Shape]:
    """Colocated fleets (each decode TP, as many workers as fit) and every
    (P at TP a x m, D at TP b x n) with m >= 1 and, for each m, as many decode workers as
    the rest of ``gpus`` holds; in a fixed order (the ranking's tie-break)."""
    if gpus < 1:
        raise ValueError("plan for at least one GPU")
    out: list[Shape] = []
    for spec in spec_modes:
        for b in sorted(set(decode_tps)):
            if b <= gpus:
                out.append(Shape(b, gpus // b, spec=spec))
        for a in sorted(set(prefill_tps)):
            for b in sorted(set(decode_tps)):
                m = 1
                while m * a + b <= gpus:
                    out.append(Shape(b, (gpus - m * a) // b, a, m, spec))
                    m += 1
    return out


@dataclass(slots=True)
class ShapePlan:
    """The configurations to simulate, and the (role, TP) shapes refused with why."""

    configs: list[FleetConfig]
    shapes: dict[str, Shape]
    infeasible: list[dict[str, Any]] = field(default_factory=list)


def profile_for(model: ModelSpec, gpu: GpuSpec, max_num_seqs: int = 256,
                budget: int = 8192) -> Profile:
    """A profile the fleet simulation can run: every engine's cost and KV cache come from
    its pool (``PoolSpec.cost``), KV moves per rank (``FleetConfig.kv_transfer_s``)."""
    return Profile(
        hardware={"kind": "gpu", "gpu": {"name": gpu.name}}, versions={}, unit="gpu",
        model={"name": model.name, "layers": model.layers, "kv_heads": model.kv_heads,
               "head_dim": model.head_dim, "hidden_size": model.hidden},
        step_cost={1: step_cost(model, gpu, 1)},
        transports={"nixl": Transport(gpu.rdma_bytes_per_s / 1e9, 0.0, gpu.rdma_latency_s)},
        default_max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        kv_bytes_per_token=model.kv_bytes_per_token(), kv_cache_tokens=1 << 40,
        units_total=gpu.node_gpus, sources=[{"what": s, "source": ""} for s in
                                            (*model.sources, *gpu.sources)],
        notes="derived from the model's architecture and the GPU's datasheet "
              "(services/plan/shapes.py); a prediction, not a measurement")


def plan_shapes(model: ModelSpec, gpu: GpuSpec, gpus: int, prefill_tps: tuple[int, ...],
                decode_tps: tuple[int, ...], longest: int, spec: SpecDecode | None = None,
                spec_modes: tuple[bool, ...] = (False,), min_batch: int = 8) -> ShapePlan:
    """The feasible configurations of ``gpus`` GPUs, as ``FleetConfig`` for the fleet
    simulation, and the role shapes refused (module doc). ``longest`` is the workload's
    longest request in tokens (prompt + output)."""
    if any(spec_modes) and spec is None:
        raise ValueError("speculative decoding needs its assumed acceptance (SpecDecode)")
    fits: dict[tuple[str, int], Fit] = {}
    for tp in sorted(set(prefill_tps)):
        fits["prefill", tp] = fit(model, gpu, tp, longest, 1)
    for tp in sorted(set(decode_tps)):
        fits["decode", tp] = fit(model, gpu, tp, longest, min_batch)
    infeasible = [{"role": role, "tp": tp, "reason": f.reason}
                  for (role, tp), f in fits.items() if not f.ok]
    plan = ShapePlan([], {}, infeasible)
    costs = {tp: step_cost(model, gpu, tp) for (_, tp), f in fits.items() if f.ok}
    for shape in enumerate_shapes(gpus, prefill_tps, decode_tps, spec_modes):
        d = fits["decode", shape.decode_tp]
        if not d.ok or (shape.prefill_n and not fits["prefill", shape.prefill_tp].ok):
            continue
        d_cost = costs[shape.decode_tp]
        if shape.spec and spec is not None:
            d_cost = spec.cost(d_cost)
        decode = PoolSpec(shape.decode_n, shape.decode_tp, cost=d_cost,
                          kv_cache_tokens=d.kv_tokens)
        prefill = None
        transfer: Callable[[int], float] | None = None
        if shape.prefill_n:
            p = fits["prefill", shape.prefill_tp]
            prefill = PoolSpec(shape.prefill_n, shape.prefill_tp,
                               cost=costs[shape.prefill_tp], kv_cache_tokens=p.kv_tokens)
            transfer = _transfer(model, gpu, shape.prefill_tp, shape.decode_tp)
        plan.configs.append(FleetConfig(shape.name, decode, prefill, transport="nixl",
                                        kv_transfer_s=transfer))
        plan.shapes[shape.name] = shape
    return plan


def _transfer(model: ModelSpec, gpu: GpuSpec, a: int, b: int) -> Callable[[int], float]:
    def seconds(tokens: int) -> float:
        return kv_transfer_s(model, gpu, a, b, tokens)
    return seconds


def rank_shapes(rows: list[dict[str, Any]], shapes: dict[str, Shape],
                key: str = "goodput") -> list[dict[str, Any]]:
    """Each configuration at the rate where it serves the most goodput per GPU, best
    first; ties (to 1e-9) go to the configuration enumerated first. ``rows`` are
    ``Prediction.row()`` dicts; ``key`` "goodput_also" ranks by the second SLO family."""
    order = {name: i for i, name in enumerate(shapes)}
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        name = r["config"]
        per_gpu = (r[key] or 0.0) / shapes[name].gpus
        if name not in best or per_gpu > best[name]["goodput_per_gpu"] + 1e-12:
            best[name] = {"config": name, **shapes[name].columns(),
                          "goodput_per_gpu": per_gpu, "rate": r["rate"],
                          "goodput": r[key], "ttft_p50": r["ttft_p50"],
                          "ttft_p99": r["ttft_p99"], "itl_p50": r["itl_p50"],
                          "itl_p99": r["itl_p99"], "tpot_p50": r["tpot_p50"]}
    return sorted(best.values(),
                  key=lambda b: (-round(b["goodput_per_gpu"], 9), order[b["config"]]))
