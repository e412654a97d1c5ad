"""The fitted cost model of one engine: what a scheduler step costs, and what a KV
transfer costs. JSON in and out (the file `pdserve plan profile` writes).

A vLLM step runs the tokens the scheduler picked: chunks of prompts being prefilled and
one token for each running sequence. Its time is modelled as linear in five features:

    step_s = base_s + prefill_token_s * P + decode_seq_s * D + attention_s * A
             + decode_context_s * C

with P the prompt tokens in the step, D the decoding sequences in it, A the prefill
attention work in millions of (query token x context token) pairs (a chunk of k tokens
after c tokens of context adds k*c + k*(k+1)/2), and C the context the decoding
sequences read, in millions of tokens. A and C are apart because on a GPU prefill
attention is bound by compute and decode attention by memory bandwidth. ``request_s``
is the fixed cost a request pays once on its way to its first token (API, input
processing, first output).
One such model per engine size (number of cores, or of GPUs), fitted by non-negative
least squares over measured requests and steps.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "pdserve-plan-profile/1"
FEATURES = ("steps", "prefill_tokens", "decode_seqs", "attention_mpairs",
            "decode_context_mtokens", "requests")


def chunk_attention(chunk: int, context: int) -> float:
    """Attention work of a prefill chunk of ``chunk`` tokens after ``context`` tokens, in
    millions of token pairs."""
    return (chunk * context + chunk * (chunk + 1) / 2) / 1e6


@dataclass(slots=True, frozen=True)
class StepCost:
    """Seconds of one engine step as a linear function of its features (module doc)."""

    base_s: float
    prefill_token_s: float
    decode_seq_s: float
    attention_s: float  # per million prefill token pairs
    decode_context_s: float  # per million context tokens read by decoding sequences
    request_s: float = 0.0

    def step_s(self, prefill_tokens: int, decode_seqs: int, attention_mpairs: float,
               decode_context_mtokens: float) -> float:
        return (self.base_s + self.prefill_token_s * prefill_tokens
                + self.decode_seq_s * decode_seqs + self.attention_s * attention_mpairs
                + self.decode_context_s * decode_context_mtokens)

    def coefficients(self) -> np.ndarray:
        return np.array([self.base_s, self.prefill_token_s, self.decode_seq_s,
                         self.attention_s, self.decode_context_s, self.request_s])

    @classmethod
    def from_coefficients(cls, c: np.ndarray | list[float]) -> StepCost:
        return cls(*(float(x) for x in c))


@dataclass(slots=True, frozen=True)
class Transport:
    """One KV transport: payload throughput, and the receiver's CPU per GB (on a CPU
    host that CPU is taken from the decode engine while a transfer lands)."""

    gb_per_s: float
    receiver_cpu_s_per_gb: float = 0.0
    latency_s: float = 0.0

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.gb_per_s * 1e9)


@dataclass(slots=True)
class Profile:
    """Everything the planner knows about one model on one kind of hardware."""

    hardware: dict[str, Any]
    model: dict[str, Any]
    versions: dict[str, str]
    unit: str  # "core" or "gpu": what engine sizes count
    step_cost: dict[int, StepCost]  # engine size (units) -> its step cost
    transports: dict[str, Transport]
    default_max_num_batched_tokens: int
    max_num_seqs: int
    kv_bytes_per_token: int
    kv_cache_tokens: int  # per engine
    units_total: int  # units on one host (cores of this machine; GPUs of one node)
    created: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)
    fit: dict[str, Any] = field(default_factory=dict)
    sources: list[dict[str, str]] = field(default_factory=list)
    notes: str = ""

    def cost(self, units: int) -> StepCost:
        """The step cost of an engine of ``units``; the nearest measured size if that one
        was not measured (a planner must not invent a scaling law it never saw)."""
        if units in self.step_cost:
            return self.step_cost[units]
        nearest = min(self.step_cost, key=lambda u: (abs(u - units), -u))
        return self.step_cost[nearest]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step_cost"] = {str(k): asdict(v) for k, v in self.step_cost.items()}
        d["transports"] = {k: asdict(v) for k, v in self.transports.items()}
        return {"format": FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file (format: {d.get('format')!r})")
        d = {k: v for k, v in d.items() if k != "format"}
        d["step_cost"] = {int(k): StepCost(**v) for k, v in d["step_cost"].items()}
        d["transports"] = {k: Transport(**v) for k, v in d["transports"].items()}
        if not d["step_cost"]:
            raise ValueError("the profile has no step cost")
        return cls(**d)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def nnls(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Non-negative least squares by an active set: fit, pin the most negative
    coefficient at zero, refit (costs cannot be negative; a negative fitted slope only
    fits noise). Rows are weighted by ``weights`` (relative errors: 1/y)."""
    w = np.ones(len(y)) if weights is None else weights
    xw, yw = x * w[:, None], y * w
    free = np.ones(x.shape[1], dtype=bool)
    free &= np.abs(x).sum(axis=0) > 0  # a feature that never occurs stays at zero
    coef = np.zeros(x.shape[1])
    while free.any():
        sol, *_ = np.linalg.lstsq(xw[:, free], yw, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[free] = sol
            break
        idx = np.flatnonzero(free)[int(np.argmin(sol))]
        free[idx] = False
    return coef


def prefill_features(prompt: int, budget: int, context: int = 0) -> np.ndarray:
    """Features (``FEATURES``) of one request prefilled alone under a step budget: its
    chunks, their tokens and attention, one request overhead."""
    steps, attn, done = 0, 0.0, 0
    while done < prompt:
        chunk = min(budget, prompt - done)
        attn += chunk_attention(chunk, context + done)
        done += chunk
        steps += 1
    return np.array([steps, prompt, 0.0, attn, 0.0, 1.0])


def decode_features(batch: int, context: int) -> np.ndarray:
    """Features of one decode step of ``batch`` sequences each with ``context`` tokens."""
    return np.array([1.0, 0.0, batch, 0.0, batch * context / 1e6, 0.0])


def fit_step_cost(samples: list[dict[str, Any]]) -> tuple[StepCost, dict[str, float]]:
    """Fits a StepCost to samples {"features": [...], "seconds": s}; returns it with its
    median and max relative error over the points it kept. Repeats of one measurement
    count by their fastest (other processes only ever add time), and one pass drops
    outliers (off by more than 3x the median error and by 25%): on a shared machine a
    measurement now and then catches another process's burst, and one such point would
    otherwise pull every coefficient."""
    fastest: dict[tuple[float, ...], float] = {}
    for s in samples:
        key = tuple(s["features"])
        fastest[key] = min(fastest.get(key, float("inf")), float(s["seconds"]))
    x = np.array(list(fastest), dtype=float)
    y = np.array(list(fastest.values()), dtype=float)
    keep = np.ones(len(y), dtype=bool)
    for _ in range(2):
        coef = nnls(x[keep], y[keep], 1.0 / np.maximum(y[keep], 1e-6))
        rel = np.abs(x @ coef - y) / np.maximum(y, 1e-9)
        keep = rel <= max(0.25, 3 * float(np.median(rel[keep])))
    rel = rel[keep]
    return StepCost.from_coefficients(coef), {
        "samples": len(samples), "points": len(y), "dropped": int((~keep).sum()),
        "median_abs_rel_error": float(np.median(rel)), "max_abs_rel_error": float(rel.max())}
