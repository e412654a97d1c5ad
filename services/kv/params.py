"""What the services around the connector and the connector's scheduler half tell each
other, through vLLM's `kv_transfer_params` (plain dicts):

* in: the "pdserve" entry of a request's SamplingParams: `SendParams` on a prefill
  request (ship the prompt's KV there), `RecvParams` on a decode request (the prompt's
  first tokens come by transfer);
* out: the `pdserve_load` entry of a decode request's final output: `LoadReport`, how
  the load went.

What the connector's two halves tell each other every step is in `metadata`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self

from services.kv.contract import Contract

KEY = "pdserve"  # our entry in kv_transfer_params
LOAD_KEY = "pdserve_load"  # the decode side's report, on its final output

# Fault injection, for tests and failure drills; workers refuse it unless enabled.
FAULT_CORRUPT_CHUNK = "corrupt_chunk"  # the sender flips bytes in one chunk after its checksum
FAULT_NOISE_KV = "noise_kv"  # the receiver overwrites the loaded blocks with noise
FAULTS = ("", FAULT_CORRUPT_CHUNK, FAULT_NOISE_KV)


def check_fault(fault: str, allowed: bool) -> None:
    """Refuse an unknown fault, and any fault on a worker that does not allow them."""
    from services.errors import InvalidRequest, PermissionDenied

    if fault not in FAULTS:
        raise InvalidRequest(f"fault: {fault!r} is not one of {FAULTS[1:]}")
    if fault and not allowed:
        raise PermissionDenied(
            "fault: fault injection is off on this worker (--allow-fault-injection)"
        )


class _Entry(Contract):
    """The "pdserve" entry of `kv_transfer_params`: the record's fields and its `role`."""

    __slots__ = ()
    ROLE: ClassVar[str]

    def to_params(self) -> dict[str, Any]:
        """The request's whole `kv_transfer_params`."""
        return {KEY: {"role": self.ROLE, **self.to_dict()}}

    @classmethod
    def of(cls, kv_transfer_params: Mapping[str, Any] | None) -> Self | None:
        """The request's entry of this role; None where it carries none (or the other
        role's); ValueError where it is malformed."""
        entry = (kv_transfer_params or {}).get(KEY)
        if not isinstance(entry, Mapping) or entry.get("role") != cls.ROLE:
            return None
        return cls.from_dict({k: v for k, v in entry.items() if k != "role"})


@dataclass(frozen=True, slots=True)
class SendParams(_Entry):
    """A prefill request's entry: ship the prompt's KV to this decode worker."""

    ROLE: ClassVar[str] = "send"

    transfer_id: str
    kv_address: str  # the decode worker's KV receiver, "host:port"
    kv_transport: str  # its network transport ("grpc", "torch" or "nixl")
    decode_epoch: int  # its epoch; a receiver that restarted since refuses the transfer
    decode_fingerprint: str  # the KV layout digest it must have
    fault: str = ""  # fault injection (FAULTS)
    # The decode worker runs on this worker's host (the router sets it when the two
    # records share `host`): the producer then ships through shared memory where shm is
    # on, else over `kv_transport`, and counts why.
    same_host: bool = False
    # Ship the prompt's blocks from this one on: the decode worker holds the ones before
    # it in its prefix cache (`reuse.first_block`).
    first_block: int = 0
    # The decode worker's receivers, one per tensor-parallel rank in rank order (empty:
    # one rank, at `kv_address`). Each prefill rank ships each decode rank its heads.
    kv_addresses: tuple[str, ...] = ()

    @property
    def rank_addresses(self) -> list[str]:
        return list(self.kv_addresses) or [self.kv_address]


@dataclass(frozen=True, slots=True)
class RecvParams(_Entry):
    """A decode request's entry: its prompt's first `num_tokens` are in the engine's prefix
    cache up to block `first_block` and in this transfer from there on."""

    ROLE: ClassVar[str] = "recv"

    transfer_id: str
    num_tokens: int
    fault: str = ""  # fault injection (FAULTS)
    # The transfer holds the prompt's blocks from this one on; this engine must hold the
    # ones before it in its prefix cache (else it computes the prompt itself).
    first_block: int = 0
    # The prefill worker's tensor-parallel size: each of its ranks sends this engine's
    # ranks their heads, so each rank here knows which pieces to wait for.
    prefill_tp: int = 1


@dataclass(frozen=True, slots=True)
class LoadReport(Contract):
    """How one load went: reported by the worker half to the scheduler half (in
    `metadata.LoadReports`), which hands it on as the `pdserve_load` entry of the
    request's final output (`to_output` / `of_output`)."""

    req_id: str  # vLLM's internal id
    transfer_id: str
    ok: bool  # the blocks were copied into the paged cache
    nbytes: int = 0  # payload bytes received
    first_byte_wall: float = 0.0  # time.time() when the transfer's header arrived
    last_byte_wall: float = 0.0  # time.time() when its last byte was verified
    chunks: int = 0  # payload pieces received (gRPC data frames; whole layers otherwise)
    checksum_s: float = 0.0  # the receiver's time verifying those pieces' checksums
    error: str = ""  # why it failed
    reused_tokens: int = 0  # prompt tokens this engine's own prefix cache held at claim time
    prompt_nbytes: int = 0  # the prompt's whole KV, every block (nbytes: what was shipped)
    # Why the prompt was computed here although KV was shipped for it ("" otherwise; then
    # `ok` says whether the blocks were loaded). See `reuse.REUSED_PREFIX_GONE`.
    recomputed: str = ""

    def merged(self, other: LoadReport) -> LoadReport:
        """One report of a load done in parts (the pieces of one rank; the ranks of one
        engine): ok only if every part is, bytes and work summed, from the first byte of
        any part to the last byte of all."""
        def first(a: float, b: float) -> float:
            return min(x for x in (a, b) if x) if a or b else 0.0

        return replace(
            self, ok=self.ok and other.ok, nbytes=self.nbytes + other.nbytes,
            first_byte_wall=first(self.first_byte_wall, other.first_byte_wall),
            last_byte_wall=max(self.last_byte_wall, other.last_byte_wall),
            chunks=self.chunks + other.chunks, checksum_s=self.checksum_s + other.checksum_s,
            error="; ".join(e for e in dict.fromkeys((self.error, other.error)) if e),
            prompt_nbytes=self.prompt_nbytes + other.prompt_nbytes,
            recomputed=self.recomputed or other.recomputed)

    def to_output(self) -> dict[str, Any]:
        """The final output's `kv_transfer_params`."""
        return {LOAD_KEY: self.to_dict()}

    @classmethod
    def of_output(cls, kv_transfer_params: Mapping[str, Any] | None) -> LoadReport | None:
        """The report on a final output (None: nothing was loaded for the request)."""
        entry = (kv_transfer_params or {}).get(LOAD_KEY)
        if entry is None:
            return None
        if not isinstance(entry, Mapping):
            raise ValueError(f"LoadReport: {LOAD_KEY!r} holds {type(entry).__name__}, "
                             "not a mapping")
        return cls.from_dict(entry)
