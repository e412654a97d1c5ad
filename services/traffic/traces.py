"""Production request traces, read as typed records and turned into a replay.

Two public formats are read, each recognised by its content (or named):

- ``azure``: the Azure LLM inference traces (CSV ``TIMESTAMP,ContextTokens,
  GeneratedTokens``; the 2023 conversation trace of the Splitwise paper). One line is
  one request: when it arrived, its prompt and output lengths. Prompt contents are not
  published, so every replayed prompt is its own random tokens (no shared prefixes),
  and no line says which conversation it belongs to: requests are sent in the trace's
  order, each on its own.
- ``mooncake``: the Mooncake traces (JSONL ``{"timestamp": ms, "input_length",
  "output_length", "hash_ids": [...]}``). Each id in ``hash_ids`` stands for one block
  of ``MOONCAKE_BLOCK_TOKENS`` prompt tokens, chained like a prefix cache: two requests
  whose lists start with the same k ids share their first k blocks.

A replay (`plan_replay`) picks a window of the trace, rescales its clock (a speed, or a
mean request rate) and its lengths (to fit the served model's context), and builds one
`RequestSpec` per request with its send time. A Mooncake id becomes one block of
``block_tokens`` token ids drawn from the id and a seed, the same block wherever the id
appears, so the replay shares exactly the prefixes the trace shares and a prefix cache
finds the trace's own reuse. Choosing ``block_tokens`` as a multiple of the engines' KV
block size keeps every shared trace block a whole cache block.

Conversations: the Mooncake trace has no session ids, but a later turn of a conversation
repeats the earlier turn's prompt (the blocks of the earlier prompt, all but the last,
partial one, start its own list). Such a request is marked to follow that earlier
request (``RequestSpec.after``): the runner sends it at its own time, or when the
earlier turn has finished if that is later, so a turn never overtakes the one before.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from services.traffic.request import RequestSpec

TRACE_FORMATS = ("azure", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512  # tokens one Mooncake hash id stands for in the trace
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# Tags that keep the generators of trace prompts apart from each other and from the other
# workloads' (numpy seeds [s] and [s, 0] give the same stream; a non-zero last word differs).
_BLOCK_STREAM, _PROMPT_STREAM = 0x626C6B, 0x707274
# A later turn is recognised by at least this many leading blocks of an earlier
# request: one shared block is the system prompt many unrelated requests start with.
MIN_TURN_BLOCKS = 2


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace, as the trace states it."""

    t_s: float  # arrival, seconds after the trace's first request
    input_len: int  # prompt tokens
    output_len: int  # output tokens
    hash_ids: tuple[int, ...] = ()  # Mooncake: one id per block of the prompt
    line: int = 0  # line of the file it came from (1-based), for messages


@dataclass(frozen=True, slots=True)
class Trace:
    path: str
    format: str
    records: tuple[TraceRecord, ...]


def detect_format(path: str | Path) -> str:
    """``azure`` or ``mooncake``, from the file's first line; ValueError otherwise."""
    with Path(path).open() as f:
        first = next((line.strip() for line in f if line.strip()), "")
    if first.startswith("{"):
        try:
            keys = set(json.loads(first))
        except ValueError:
            keys = set()
        if {"timestamp", "input_length", "output_length"} <= keys:
            return "mooncake"
    elif {c.lower() for c in AZURE_COLUMNS} <= {c.strip().lower() for c in first.split(",")}:
        return "azure"
    raise ValueError(
        f"{path}: not a trace format this reads (Azure CSV with columns "
        f"{','.join(AZURE_COLUMNS)}, or Mooncake JSONL with timestamp, input_length, "
        "output_length): name the format with --trace-format if it is one of them")


def parse_azure_time(text: str) -> float:
    """Epoch seconds of an Azure trace timestamp, e.g. ``2023-11-16 18:15:46.6805900``
    (seven fraction digits, which ``datetime`` does not read) or with a ``+00:00``."""
    text = text.strip()
    zone = ""
    for sign in ("+", "-"):
        head, sep, tail = text.rpartition(sign)
        if sep and ":" in tail and " " in head:  # a UTC offset after the time
            text, zone = head, sign + tail
            break
    whole, _, frac = text.partition(".")
    stamp = datetime.fromisoformat(whole.replace(" ", "T") + (zone or "+00:00"))
    return stamp.timestamp() + (float("0." + frac) if frac else 0.0)


def _positive(value: Any, what: str, where: str, minimum: int = 1) -> int:
    number = int(value)
    if number < minimum:
        raise ValueError(f"{where}: {what} must be >= {minimum}, got {value}")
    return number


def read_azure(path: str | Path) -> list[TraceRecord]:
    records: list[tuple[float, int, int, int]] = []
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        names = {name.strip().lower(): name for name in reader.fieldnames or ()}
        missing = [c for c in AZURE_COLUMNS if c.lower() not in names]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)} (an Azure trace has "
                             f"{','.join(AZURE_COLUMNS)})")
        col = {c: names[c.lower()] for c in AZURE_COLUMNS}
        for row in reader:
            where = f"{path}:{reader.line_num}"
            try:
                t = parse_azure_time(row[col["TIMESTAMP"]])
                prompt = _positive(row[col["ContextTokens"]], "ContextTokens", where)
                output = _positive(row[col["GeneratedTokens"]], "GeneratedTokens", where)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where}: bad Azure trace line: {exc}") from None
            records.append((t, prompt, output, reader.line_num))
    return _from_times([(t, TraceRecord(0.0, i, o, (), n)) for t, i, o, n in records])


def read_mooncake(path: str | Path) -> list[TraceRecord]:
    rows: list[tuple[float, TraceRecord]] = []
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                item = json.loads(line)
                t = float(item["timestamp"]) / 1000.0
                prompt = _positive(item["input_length"], "input_length", where)
                output = _positive(item["output_length"], "output_length", where)
                ids = tuple(int(h) for h in item.get("hash_ids") or ())
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{where}: bad Mooncake trace line: {exc!r}") from None
            if ids and not ((len(ids) - 1) * MOONCAKE_BLOCK_TOKENS < prompt
                            <= len(ids) * MOONCAKE_BLOCK_TOKENS):
                raise ValueError(
                    f"{where}: {len(ids)} hash ids do not cover input_length {prompt} in "
                    f"blocks of {MOONCAKE_BLOCK_TOKENS} tokens")
            rows.append((t, TraceRecord(0.0, prompt, output, ids, n)))
    return _from_times(rows)


def _from_times(rows: list[tuple[float, TraceRecord]]) -> list[TraceRecord]:
    """Records in arrival order (stable for equal times), times from the first one."""
    rows.sort(key=lambda row: row[0])
    if not rows:
        return []
    t0 = rows[0][0]
    return [TraceRecord(t - t0, r.input_len, r.output_len, r.hash_ids, r.line) for t, r in rows]


def read_trace(path: str | Path, fmt: str | None = None) -> Trace:
    """Every request of a trace file, in arrival order; ``fmt`` None or "auto": detected."""
    if not Path(path).is_file():
        raise ValueError(f"no trace file {path}")
    fmt = detect_format(path) if fmt in (None, "auto") else fmt
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; choose from {TRACE_FORMATS}")
    records = read_azure(path) if fmt == "azure" else read_mooncake(path)
    if not records:
        raise ValueError(f"{path}: the trace has no requests")
    return Trace(str(path), fmt, tuple(records))


def window(records: Sequence[TraceRecord], start_s: float = 0.0,
           duration_s: float | None = None, max_requests: int | None = None,
           ) -> list[TraceRecord]:
    """The requests that arrived in [start_s, start_s + duration_s) of trace time, at
    most the first ``max_requests`` of them."""
    if start_s < 0:
        raise ValueError(f"the trace window's start must be >= 0 s, got {start_s}")
    if duration_s is not None and duration_s <= 0:
        raise ValueError(f"the trace window's duration must be > 0 s, got {duration_s}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"the request count must be >= 1, got {max_requests}")
    end = math.inf if duration_s is None else start_s + duration_s
    picked = [r for r in records if start_s <= r.t_s < end][:max_requests]
    if not picked:
        last = records[-1].t_s if records else 0.0
        raise ValueError(f"no request of the trace arrived in the window from {start_s} s "
                         f"(for {duration_s or 'all remaining'} s); the trace spans "
                         f"0-{last:.1f} s")
    return picked


def conversations(records: Sequence[TraceRecord]) -> list[int]:
    """For each record, the index of the first turn of its conversation (its own index
    when it continues no earlier record), from `previous_turns`."""
    roots: list[int] = []
    for i, prev in enumerate(previous_turns(records)):
        roots.append(i if prev is None else roots[prev])
    return roots


def sample_conversations(records: Sequence[TraceRecord], count: int, seed: int = 0,
                         min_turns: int = 1) -> list[TraceRecord]:
    """Every turn of ``count`` conversations drawn at random (seeded) from ``records``,
    in arrival order: a small replay that keeps the trace's reuse between turns, which a
    short run of consecutive requests mostly misses (turns come minutes apart). Only
    conversations of at least ``min_turns`` requests are drawn (1: any)."""
    if count < 1:
        raise ValueError(f"the number of conversations must be >= 1, got {count}")
    if min_turns < 1:
        raise ValueError(f"a conversation has at least 1 turn, got min_turns {min_turns}")
    roots = conversations(records)
    turns = Counter(roots)
    firsts = sorted(r for r, n in turns.items() if n >= min_turns)
    if not firsts:
        raise ValueError(f"no conversation of the window has {min_turns} turns or more "
                         f"(the longest has {max(turns.values(), default=0)})")
    rng = np.random.default_rng(seed)
    chosen = set(rng.choice(firsts, size=min(count, len(firsts)), replace=False).tolist())
    return [r for r, root in zip(records, roots, strict=True) if root in chosen]


def send_times(records: Sequence[TraceRecord], speed: float = 1.0,
               rate: float | None = None) -> np.ndarray:
    """Send offsets of the records, seconds from the first: the trace's own gaps divided
    by ``speed``, or stretched so that the mean request rate is ``rate`` (the last of n
    requests then leaves at (n - 1) / rate)."""
    times = np.asarray([r.t_s for r in records], dtype=float)
    times = times - times[0] if times.size else times
    if rate is not None:
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"the replay's request rate must be a positive number, got {rate}")
        if times.size < 2 or times[-1] <= 0:
            raise ValueError("a request rate needs a window of at least two requests that "
                             "did not all arrive at once: widen the window, or use --speed")
        return times * ((times.size - 1) / rate / times[-1])
    if not speed > 0 or math.isinf(speed):
        raise ValueError(f"the replay's speed must be a positive number, got {speed}")
    return times / speed


def previous_turns(records: Sequence[TraceRecord]) -> list[int | None]:
    """For each record, the index of the earlier record it continues (a later turn of a
    conversation), or None. A record continues the most recent earlier one whose blocks,
    all of them or all but the last, start its own ``hash_ids``, over at least
    ``MIN_TURN_BLOCKS`` blocks."""
    latest: dict[tuple[int, ...], int] = {}  # a prompt's blocks -> last request with them
    out: list[int | None] = []
    for i, rec in enumerate(records):
        ids = rec.hash_ids
        found: int | None = None
        for k in range(len(ids), MIN_TURN_BLOCKS - 1, -1):
            if (j := latest.get(ids[:k])) is not None:
                found = j
                break
        out.append(found)
        if len(ids) >= MIN_TURN_BLOCKS:
            latest[ids] = i
        if len(ids) - 1 >= MIN_TURN_BLOCKS:
            latest[ids[:-1]] = i
    return out


@dataclass(frozen=True, slots=True)
class LengthPlan:
    """How the trace's lengths become the replay's.

    Every length is multiplied by ``factor`` (prompts rounded up, so a Mooncake prompt
    keeps its number of blocks; outputs rounded, at least 1). A request still longer than
    ``max_model_len`` is clipped: its output to at most half the context, then its prompt
    cut from the end (its shared prefix kept) so prompt + output fits."""

    factor: float
    max_model_len: int
    block_tokens: int = 0  # Mooncake: tokens one hash id becomes (factor * 512)

    def scale(self, rec: TraceRecord) -> tuple[int, int, bool]:
        """(prompt tokens, output tokens, clipped) of one record."""
        prompt = max(1, math.ceil(rec.input_len * self.factor - 1e-9))
        output = max(1, round(rec.output_len * self.factor))
        clipped = prompt + output > self.max_model_len
        if clipped:
            output = max(1, min(output, self.max_model_len // 2))
            prompt = max(1, min(prompt, self.max_model_len - output))
        return prompt, output, clipped


def plan_lengths(trace_format: str, records: Sequence[TraceRecord], max_model_len: int,
                 scale: float | None = None, kv_block_size: int = 128) -> LengthPlan:
    """The length plan of a replay. ``scale`` None (auto): Mooncake maps each trace
    block to one KV block (factor kv_block_size / 512); Azure is scaled down, if at all,
    so that 99% of the window's requests fit the context. With an explicit ``scale``, a
    Mooncake block becomes the nearest whole number of KV blocks (at least one) to
    ``scale`` * 512 tokens, and the factor is that over 512."""
    if max_model_len < 2:
        raise ValueError(f"the served model's context must be >= 2 tokens, got {max_model_len}")
    if scale is not None and not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"the length scale must be a positive number, got {scale}")
    if trace_format == "mooncake":
        if kv_block_size < 1:
            raise ValueError(f"the KV block size must be >= 1, got {kv_block_size}")
        blocks = 1 if scale is None else max(1, round(scale * MOONCAKE_BLOCK_TOKENS
                                                      / kv_block_size))
        block_tokens = blocks * kv_block_size
        return LengthPlan(block_tokens / MOONCAKE_BLOCK_TOKENS, max_model_len, block_tokens)
    if scale is None:
        totals = [r.input_len + r.output_len for r in records]
        p99 = float(np.percentile(totals, 99)) if totals else 1.0
        scale = min(1.0, max_model_len / p99)
    return LengthPlan(scale, max_model_len)


class TokenBlocks:
    """The token ids of each Mooncake hash id: ``block_tokens`` ids drawn from ``pool``
    by a generator seeded with (seed, id), so an id is the same block in every request,
    run and process, and different seeds give different content of the same shape."""

    def __init__(self, pool: np.ndarray, block_tokens: int, seed: int = 0) -> None:
        if block_tokens < 1:
            raise ValueError(f"a block needs >= 1 token, got {block_tokens}")
        if len(pool) == 0:
            raise ValueError("no token ids to draw prompts from")
        self.pool, self.block_tokens, self.seed = pool, block_tokens, seed
        self._cache: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        if (ids := self._cache.get(hash_id)) is None:
            rng = np.random.default_rng([self.seed, hash_id & 0xFFFFFFFFFFFFFFFF,
                                         _BLOCK_STREAM])
            ids = self._cache[hash_id] = [int(t) for t in rng.choice(self.pool,
                                                                     self.block_tokens)]
        return ids

    def prompt(self, hash_ids: Sequence[int], length: int) -> list[int]:
        """The first ``length`` tokens of the blocks of ``hash_ids``."""
        need = math.ceil(length / self.block_tokens)
        if need > len(hash_ids):
            raise ValueError(f"{len(hash_ids)} blocks of {self.block_tokens} tokens cannot "
                             f"make a {length}-token prompt")
        out: list[int] = []
        for h in hash_ids[:need]:
            out.extend(self.block(h))
        return out[:length]


@dataclass(slots=True)
class ReplayConfig:
    """What part of a trace is replayed, and how; see `plan_replay`."""

    path: str
    format: str | None = None  # None: detected from the content
    start_s: float = 0.0  # window start, seconds of trace time
    duration_s: float | None = None  # window length in trace time; None: to the end
    max_requests: int | None = None  # at most the first N requests of the window
    speed: float = 1.0  # trace time / replay time
    rate: float | None = None  # instead of speed: the replay's mean request rate
    length_scale: float | None = None  # None: auto (see `plan_lengths`)
    max_model_len: int = 2048
    kv_block_size: int = 128
    keep_turn_order: bool = True
    conversations: int | None = None  # Mooncake: replay only this many conversations
    seed: int = 0  # token content of the prompts
    sample_seed: int = 0  # which conversations ``conversations`` draws
    min_turns: int = 1  # ``conversations`` draws only conversations of this many turns


@dataclass(slots=True)
class Replay:
    specs: list[RequestSpec]
    lengths: LengthPlan
    description: dict[str, Any] = field(default_factory=dict)
    # Per request: the leading prompt tokens that earlier requests of the window sent as
    # whole blocks (Mooncake only; a prefix cache keeps only whole blocks): what one
    # cache holding everything sent before could skip computing.
    reused_tokens: list[int] = field(default_factory=list)

    @property
    def mean_rate(self) -> float:
        """Requests per second the replay offers, over its span (inf: all at once)."""
        span = self.specs[-1].at_s or 0.0
        return (len(self.specs) - 1) / span if span > 0 else math.inf


def plan_replay(cfg: ReplayConfig, pool: np.ndarray, trace: Trace | None = None) -> Replay:
    """The requests of a trace replay with their send times (``RequestSpec.at_s``) and
    turn order (``RequestSpec.after``), and a description of what was done to the trace
    for the report."""
    if cfg.speed != 1.0 and cfg.rate is not None:
        raise ValueError("give the replay a speed or a request rate, not both")
    trace = trace or read_trace(cfg.path, cfg.format)
    if cfg.conversations is None:
        records = window(trace.records, cfg.start_s, cfg.duration_s, cfg.max_requests)
    else:
        if trace.format != "mooncake":
            raise ValueError("only a Mooncake trace says which requests are turns of one "
                             "conversation: sample an Azure trace by its window")
        records = sample_conversations(window(trace.records, cfg.start_s, cfg.duration_s),
                                       cfg.conversations, cfg.sample_seed, cfg.min_turns)
        records = window(records, max_requests=cfg.max_requests)
    times = send_times(records, cfg.speed, cfg.rate)
    lengths = plan_lengths(trace.format, records, cfg.max_model_len, cfg.length_scale,
                           cfg.kv_block_size)
    turns = (previous_turns(records) if trace.format == "mooncake" and cfg.keep_turn_order
             else [None] * len(records))
    rng = np.random.default_rng([cfg.seed, _PROMPT_STREAM])
    blocks = (TokenBlocks(pool, lengths.block_tokens, cfg.seed)
              if trace.format == "mooncake" else None)
    specs: list[RequestSpec] = []
    reused_tokens: list[int] = []
    clipped = 0
    seen: set[tuple[int, ...]] = set()
    whole: set[tuple[int, ...]] = set()  # prefixes whose last block was sent whole
    reused_blocks = total_blocks = 0
    for i, (rec, t) in enumerate(zip(records, times.tolist(), strict=True)):
        prompt_len, output_len, was_clipped = lengths.scale(rec)
        clipped += was_clipped
        cached = 0
        if blocks is not None and rec.hash_ids:
            ids = blocks.prompt(rec.hash_ids, prompt_len)
            used = rec.hash_ids[:math.ceil(prompt_len / lengths.block_tokens)]
            cached = next((k for k in range(len(used)) if used[:k + 1] not in whole),
                          len(used))  # chained ids: the hits are a leading run
            for k in range(1, len(used) + 1):  # the trace's own prefix reuse, as replayed
                total_blocks += 1
                reused_blocks += used[:k] in seen
                seen.add(used[:k])
            whole.update(used[:k] for k in range(1, prompt_len // lengths.block_tokens + 1))
        else:
            ids = [int(x) for x in rng.choice(pool, prompt_len)]
        reused_tokens.append(min(prompt_len, cached * lengths.block_tokens))
        kind = trace.format if turns[i] is None else f"{trace.format}-next-turn"
        specs.append(RequestSpec(ids, output_len, kind, at_s=t, after=turns[i]))
    prompts = np.asarray([len(s.prompt_ids) for s in specs])
    outputs = np.asarray([s.output_len for s in specs])
    span = float(records[-1].t_s - records[0].t_s)
    description: dict[str, Any] = {
        "file": Path(trace.path).name, "format": trace.format,
        "requests_in_file": len(trace.records),
        "window": {"start_s": cfg.start_s, "duration_s": cfg.duration_s,
                   "max_requests": cfg.max_requests, "conversations": cfg.conversations,
                   "min_turns": cfg.min_turns,
                   "requests": len(records),
                   "trace_span_s": span,
                   "trace_rate": (len(records) - 1) / span if span > 0 else None},
        "speed": None if cfg.rate is not None else cfg.speed,
        "rate": cfg.rate,
        "lengths": {
            "factor": lengths.factor, "max_model_len": lengths.max_model_len,
            "clipped_requests": clipped,
            "rule": ("lengths x factor (prompts rounded up, outputs rounded); a request "
                     "still over max_model_len: output capped at half of it, then the "
                     "prompt cut from its end"),
            "prompt_tokens": {"mean": float(prompts.mean()), "max": int(prompts.max())},
            "output_tokens": {"mean": float(outputs.mean()), "max": int(outputs.max())},
            "trace_prompt_tokens_mean": float(np.mean([r.input_len for r in records])),
            "trace_output_tokens_mean": float(np.mean([r.output_len for r in records])),
        },
        "turns": {
            "next_turn_requests": sum(t is not None for t in turns),
            "ordering": ("a later turn (a request that repeats an earlier request's "
                         "blocks) is sent at its time or when that request has finished, "
                         "whichever is later" if trace.format == "mooncake"
                         and cfg.keep_turn_order else
                         "no session ids in the trace: requests are sent at their own "
                         "times, each on its own"),
        },
        "seed": cfg.seed,
    }
    if blocks is not None:
        description["lengths"]["block_tokens"] = lengths.block_tokens
        description["prefix_reuse"] = {
            "blocks": total_blocks, "reused_blocks": reused_blocks,
            "share": reused_blocks / total_blocks if total_blocks else 0.0,
            "meaning": "share of the replayed prompt blocks that an earlier request of "
                       "the window already sent (the trace's own prefix reuse)",
        }
    return Replay(specs, lengths, description, reused_tokens)
