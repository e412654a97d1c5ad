"""Workloads: which prompts to send and how many tokens to ask for.

Every request is a list of token ids, so the server sees exactly the lengths the workload
chose (text prompts re-tokenize differently at the server). Lengths of text prompts are
counted with the model's own tokenizer. One seed fixes everything: the same config and
seed give the same requests on every run and every machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from services.traffic.request import RequestSpec

DISTRIBUTIONS = ("fixed", "uniform", "normal", "lognormal")
DATASETS = ("random", "shared-prefix", "mixed", "sharegpt", "prompts")


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the workloads use."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


def load_tokenizer(model_dir: str) -> Tokenizer:
    """The model's tokenizer, from a local Hugging Face model folder."""
    from transformers import AutoTokenizer  # slow import: only when a tokenizer is needed

    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer


@dataclass(slots=True, frozen=True)
class LengthDist:
    """A distribution of token counts around ``mean``.

    ``spread`` means: uniform -> lengths in [mean*(1-spread), mean*(1+spread)] (vLLM's
    range ratio); normal -> std = spread*mean; lognormal -> sigma of the log, with the
    mean kept at ``mean``; fixed -> ignored. Samples are clipped to [1, max_len].
    """

    mean: int
    dist: str = "fixed"
    spread: float = 0.0
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"mean length must be >= 1, got {self.mean}")
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"unknown length distribution {self.dist!r}")
        if self.spread < 0 or (self.dist == "uniform" and self.spread > 1):
            raise ValueError(f"bad spread {self.spread} for {self.dist}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "fixed" or self.spread == 0:
            values = np.full(n, float(self.mean))
        elif self.dist == "uniform":
            low = max(1, round(self.mean * (1 - self.spread)))
            high = max(low, round(self.mean * (1 + self.spread)))
            values = rng.integers(low, high, size=n, endpoint=True).astype(float)
        elif self.dist == "normal":
            values = rng.normal(self.mean, self.spread * self.mean, size=n)
        else:
            mu = np.log(self.mean) - self.spread**2 / 2
            values = rng.lognormal(mu, self.spread, size=n)
        upper = self.max_len if self.max_len is not None else np.inf
        return np.clip(np.rint(values), 1, upper).astype(np.int64)


@dataclass(slots=True)
class WorkloadConfig:
    """Everything that defines a workload; see ``build_workload``."""

    dataset: str = "random"
    num_requests: int = 100
    seed: int = 0
    input_len: LengthDist = field(default_factory=lambda: LengthDist(256))
    output_len: LengthDist = field(default_factory=lambda: LengthDist(128))
    path: str | None = None  # sharegpt / prompts file
    num_prefixes: int = 4  # shared-prefix: distinct prefixes
    prefix_len: int = 512  # shared-prefix: tokens in each prefix
    long_share: float = 0.1  # mixed: share of long prompts
    long_input_len: LengthDist = field(default_factory=lambda: LengthDist(1800))
    long_output_len: LengthDist = field(default_factory=lambda: LengthDist(16))
    sharegpt_output_from_file: bool = True  # use the reply's length, else output_len
    max_prompt_len: int = 1024  # sharegpt: skip longer conversations (as vLLM does)
    max_total_len: int = 2048
    vocab_size: int | None = None  # token id range when no tokenizer is given
    with_text: bool = False  # also fill prompt_text (for text-only servers)

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose from {DATASETS}")
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not 0.0 <= self.long_share <= 1.0:
            raise ValueError("long_share must be in [0, 1]")
        if self.dataset in ("sharegpt", "prompts") and not self.path:
            raise ValueError(f"dataset {self.dataset!r} needs a file path")


def token_pool(tokenizer: Tokenizer | None, vocab_size: int | None) -> np.ndarray:
    """Token ids random prompts draw from: the vocabulary less special tokens."""
    if tokenizer is not None:
        ids = np.arange(len(tokenizer))
        return np.setdiff1d(ids, np.asarray(tokenizer.all_special_ids, dtype=np.int64))
    if not vocab_size:
        raise ValueError("random prompts need a tokenizer or a vocab size")
    return np.arange(vocab_size)


def _random_ids(rng: np.random.Generator, pool: np.ndarray, n: int) -> list[int]:
    return [int(i) for i in rng.choice(pool, size=n)]


def random_workload(cfg: WorkloadConfig, pool: np.ndarray) -> list[RequestSpec]:
    rng = np.random.default_rng(cfg.seed)
    ins = cfg.input_len.sample(rng, cfg.num_requests)
    outs = cfg.output_len.sample(rng, cfg.num_requests)
    return [RequestSpec(_random_ids(rng, pool, int(i)), int(o))
            for i, o in zip(ins, outs, strict=True)]


def shared_prefix_workload(cfg: WorkloadConfig, pool: np.ndarray) -> list[RequestSpec]:
    """``num_prefixes`` groups; each request is its group's prefix plus its own suffix."""
    rng = np.random.default_rng(cfg.seed)
    prefixes = [_random_ids(rng, pool, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    groups = rng.integers(0, cfg.num_prefixes, size=cfg.num_requests)
    suffixes = cfg.input_len.sample(rng, cfg.num_requests)
    outs = cfg.output_len.sample(rng, cfg.num_requests)
    return [
        RequestSpec(prefixes[g] + _random_ids(rng, pool, int(s)), int(o), "shared-prefix")
        for g, s, o in zip(groups, suffixes, outs, strict=True)
    ]


def mixed_workload(cfg: WorkloadConfig, pool: np.ndarray) -> list[RequestSpec]:
    """Chat-length requests with exactly round(n * long_share) long prompts among them,
    at seeded positions (an exact count keeps small runs comparable)."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    is_long = np.zeros(n, dtype=bool)
    is_long[rng.permutation(n)[: round(n * cfg.long_share)]] = True
    chat_in, chat_out = cfg.input_len.sample(rng, n), cfg.output_len.sample(rng, n)
    long_in, long_out = cfg.long_input_len.sample(rng, n), cfg.long_output_len.sample(rng, n)
    specs = []
    for i in range(n):
        if is_long[i]:
            specs.append(RequestSpec(_random_ids(rng, pool, int(long_in[i])), int(long_out[i]),
                                     "long"))
        else:
            specs.append(RequestSpec(_random_ids(rng, pool, int(chat_in[i])), int(chat_out[i]),
                                     "chat"))
    return specs


def _sharegpt_pairs(data: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(first user turn, the reply) of each ShareGPT conversation."""
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        prompt = first.get("value", first.get("content", ""))
        answer = reply.get("value", reply.get("content", ""))
        if prompt:
            pairs.append((str(prompt), str(answer)))
    return pairs


def sharegpt_workload(cfg: WorkloadConfig, tokenizer: Tokenizer) -> list[RequestSpec]:
    """Conversations from a ShareGPT-format JSON file, shuffled with the seed; skips the
    too short (< 4 tokens) and too long ones, as ``vllm bench serve`` does."""
    assert cfg.path is not None
    data = json.loads(Path(cfg.path).read_text())
    pairs = _sharegpt_pairs(data)
    rng = np.random.default_rng(cfg.seed)
    fixed_out = cfg.output_len.sample(rng, cfg.num_requests)
    specs: list[RequestSpec] = []
    for idx in rng.permutation(len(pairs)):
        if len(specs) == cfg.num_requests:
            break
        prompt, answer = pairs[idx]
        ids = list(tokenizer.encode(prompt))
        out = len(tokenizer.encode(answer)) if cfg.sharegpt_output_from_file else int(
            fixed_out[len(specs)])
        if len(ids) < 4 or out < 4 or len(ids) > cfg.max_prompt_len:
            continue
        if len(ids) + out > cfg.max_total_len:
            continue
        specs.append(RequestSpec(ids, out, "sharegpt", prompt))
    if not specs:
        raise ValueError(f"no usable conversations in {cfg.path}")
    return _cycle(specs, cfg.num_requests)


def prompt_file_workload(cfg: WorkloadConfig, tokenizer: Tokenizer) -> list[RequestSpec]:
    """Prompts from a text file (one per line) or a JSONL file ({"prompt": ...} per line)."""
    assert cfg.path is not None
    lines = [ln for ln in Path(cfg.path).read_text().splitlines() if ln.strip()]
    if cfg.path.endswith(".jsonl"):
        lines = [str(json.loads(ln)["prompt"]) for ln in lines]
    if not lines:
        raise ValueError(f"no prompts in {cfg.path}")
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(lines))
    outs = cfg.output_len.sample(rng, cfg.num_requests)
    specs = []
    for i in range(cfg.num_requests):
        text = lines[order[i % len(lines)]]
        specs.append(RequestSpec(list(tokenizer.encode(text)), int(outs[i]), "prompt", text))
    return specs


def _cycle(specs: list[RequestSpec], n: int) -> list[RequestSpec]:
    return [specs[i % len(specs)] for i in range(n)]


def build_workload(cfg: WorkloadConfig, tokenizer: Tokenizer | None) -> list[RequestSpec]:
    """The requests ``cfg`` describes, in send order."""
    if cfg.dataset in ("sharegpt", "prompts"):
        if tokenizer is None:
            raise ValueError(f"dataset {cfg.dataset!r} needs the model's tokenizer")
        if cfg.dataset == "sharegpt":
            return sharegpt_workload(cfg, tokenizer)
        return prompt_file_workload(cfg, tokenizer)
    pool = token_pool(tokenizer, cfg.vocab_size)
    builders = {"random": random_workload, "shared-prefix": shared_prefix_workload,
                "mixed": mixed_workload}
    specs = builders[cfg.dataset](cfg, pool)
    if cfg.with_text:
        if tokenizer is None:
            raise ValueError("text prompts need the model's tokenizer")
        for spec in specs:
            spec.prompt_text = tokenizer.decode(spec.prompt_ids)
    return specs
