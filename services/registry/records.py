"""What the registry knows about a worker: who it is, where, and how loaded.

Records are read tolerantly, because Redis is shared and outlives any one version of
pdserve: unknown fields are ignored (a newer writer), missing optional fields take their
defaults (an older writer). What cannot be a worker (not JSON, a required field missing,
a wrong type, an unknown role or transport) raises `BadRecord` with a short reason, so
the reader can skip that one record and go on with the others.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

ROLES = ("prefill", "decode")
KV_TRANSPORTS = ("", "grpc", "torch", "nixl")


class BadRecord(ValueError):
    """A record that is skipped. `reason` is one of: json (not a JSON object), schema
    (a field missing, of the wrong type or out of range), signature (no valid HMAC
    under the cluster secret), stale (signed, but older than the replay window)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load report, published with every heartbeat."""

    waiting: int = 0  # requests queued in the engine
    running: int = 0  # requests being computed
    queued_prompt_tokens: int = 0  # prompt tokens not yet prefilled
    kv_usage: float = 0.0  # share of the KV cache in use, 0..1


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    worker_id: str
    role: str  # "prefill" or "decode"
    address: str  # gRPC "host:port"
    host: str  # machine identity: pairs on one host transfer KV cheaper
    epoch: int  # restart epoch
    fingerprint: str  # KV layout digest
    kv_address: str = ""  # decode: where KV transfers are received (its first rank's)
    kv_transport: str = ""
    metrics_port: int = 0  # Prometheus port on `host` of the address (0 = none)
    # Where Prometheus scrapes this worker ("host:port"; "" = none, or an older writer:
    # then the host of `address` with `metrics_port`). Its own field because the metrics
    # port may bind another interface than the gRPC API (`metrics_host`).
    metrics_address: str = ""
    capacity: int = 64  # most running sequences (max_num_seqs)
    model: str = ""  # served model name
    max_model_len: int = 0
    vocab_size: int = 0
    dtype: str = ""
    # The KV layout, for operators and the planner (the fingerprint decides pairing):
    # tensor-parallel size, KV heads in each rank's cache and tokens per KV block
    # (0 = not reported: an older writer).
    tp: int = 1
    kv_heads: int = 0
    block_size: int = 0
    # The worker serves its engine's KV cache events (WatchKVEvents, on `address`):
    # routers watch them and learn which prompt blocks the engine holds. False (events
    # off, or an older writer): routers use the approximate prefix index for it.
    kv_events: bool = False
    load: WorkerLoad = field(default_factory=WorkerLoad)
    updated: float = 0.0  # time.time() of the last heartbeat
    pid: int = 0  # the serving process, for operators (and failure drills)
    # The LoRA adapters the worker has loaded, (name, folder), sorted by name: the router
    # pairs a request naming one with workers that hold it.
    loras: tuple[tuple[str, str], ...] = ()
    # decode: one KV receiver per tensor-parallel rank, in rank order ("host:port" each;
    # empty: one rank, at `kv_address`). Prefill ranks send each rank its KV heads.
    kv_addresses: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        """Parse a record; `BadRecord` if it cannot be a worker."""
        return cls.from_dict(json_object(text))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerRecord:
        values = _typed_fields(cls, d)
        values["load"] = WorkerLoad(**_typed_fields(WorkerLoad, _object(d.get("load", {}))))
        values["loras"] = _adapter_pairs(d.get("loras", []))
        values["kv_addresses"] = _addresses(d.get("kv_addresses", []))
        record = cls(**values)
        _check_values(record)
        return record

    @property
    def metrics_target(self) -> str:
        """The worker's Prometheus endpoint as "host:port" ("" = it serves none)."""
        if self.metrics_address:
            return self.metrics_address
        if not self.metrics_port:
            return ""
        return f"{self.address.rpartition(':')[0]}:{self.metrics_port}"

    @property
    def adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters: name -> folder."""
        return dict(self.loras)

    @property
    def saturated(self) -> bool:
        return self.load.running + self.load.waiting >= self.capacity


def json_object(text: str | bytes) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRecord("json", f"not JSON ({e})") from None
    return _object(value)


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRecord("json" if not isinstance(value, list) else "schema",
                        f"expected a JSON object, got {type(value).__name__}")
    return value


# The JSON types each annotation accepts (bool is an int in Python, never in a record:
# a bool only where the field is one).
_ACCEPTS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float),
                                         "bool": (bool,)}


def _typed_fields(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """The known fields of `d`, type-checked; unknown ones ignored, absent optional ones
    left to their defaults."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in ("load", "loras", "kv_addresses"):
            continue
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise BadRecord("schema", f"field {f.name!r} is missing")
            continue
        value = d[f.name]
        accepted = _ACCEPTS[str(f.type)]
        if isinstance(value, bool) != (str(f.type) == "bool") or not isinstance(value, accepted):
            raise BadRecord("schema", f"field {f.name!r} is {type(value).__name__}, "
                            f"expected {f.type}")
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRecord("schema", f"field {f.name!r} is not finite")
        out[f.name] = float(d[f.name]) if f.type == "float" else value
    return out


def _addresses(value: Any) -> tuple[str, ...]:
    """`kv_addresses` as written (["host:port", ...]), checked."""
    if not isinstance(value, list | tuple) or not all(isinstance(a, str) for a in value):
        raise BadRecord("schema", "field 'kv_addresses' is not a list of strings")
    for address in value:
        _check_address("kv_addresses", address)
    return tuple(value)


def _adapter_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """`loras` as written ([[name, folder], ...]), checked."""
    if not isinstance(value, list | tuple):
        raise BadRecord("schema", f"field 'loras' is {type(value).__name__}, expected a list")
    pairs = []
    for item in value:
        if (not isinstance(item, list | tuple) or len(item) != 2
                or not all(isinstance(x, str) and x for x in item)):
            raise BadRecord("schema", "field 'loras' holds an entry that is not [name, folder]")
        pairs.append((item[0], item[1]))
    return tuple(sorted(pairs))


def _check_values(r: WorkerRecord) -> None:
    """Values the router would act on: refused here rather than deep in a request."""
    if not r.worker_id:
        raise BadRecord("schema", "empty worker_id")
    if r.role not in ROLES:
        raise BadRecord("schema", f"unknown role {r.role[:40]!r}")
    if r.kv_transport not in KV_TRANSPORTS:
        raise BadRecord("schema", f"unknown kv_transport {r.kv_transport[:40]!r}")
    for name in ("address", "kv_address", "metrics_address"):
        value = getattr(r, name)
        if value or name == "address":
            _check_address(name, value)
    if r.capacity < 1 or r.metrics_port < 0 or r.metrics_port > 65535:
        raise BadRecord("schema", "capacity or metrics_port out of range")
    if r.tp < 1 or r.kv_heads < 0 or r.block_size < 0:
        raise BadRecord("schema", f"tp {r.tp} must be >= 1, kv_heads {r.kv_heads} and "
                        f"block_size {r.block_size} >= 0")


# The parts of a KV layout a record names, as people read them.
_LAYOUT = (("model", "model"), ("dtype", "dtype"), ("tp", "tensor-parallel size"),
           ("kv_heads", "KV heads per rank"), ("block_size", "KV block size"))


def layout_differences(a: WorkerRecord, b: WorkerRecord) -> list[str]:
    """Why KV cannot move between `a` and `b`, one phrase per part of the layout that
    differs ("tensor-parallel size 1 != 2"); [] when their fingerprints agree. A part
    either writer left unreported is not compared; when no reported part differs, the
    fingerprints still do, and the phrase says so."""
    if a.fingerprint == b.fingerprint:
        return []
    out = [f"{words} {getattr(a, name)!r} != {getattr(b, name)!r}" for name, words in _LAYOUT
           if getattr(a, name) and getattr(b, name) and getattr(a, name) != getattr(b, name)]
    return out or [f"KV layout fingerprint {a.fingerprint} != {b.fingerprint}, in a part "
                   "the records do not report (layers, head size, page packing, pdserve "
                   "version)"]


def _check_address(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRecord("schema", f"{name} {value[:60]!r} is not host:port")
