"""``RequestRecord``: what one request measured, with the server's own timings
(``ServerTimings``) where it sent them.

Records are plain dataclasses that round-trip through JSON, so records written by several
load-generator processes can be concatenated and summarised together, and a simulated
request can be written as one: every timestamp that crosses a process boundary is
wall-clock (epoch seconds), and every interval inside a request is an offset from that
request's own send time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ServerTimings:
    """Server-side anatomy from pdserve's final message (pdserve.v1.Timings), in seconds."""

    queue_s: float = 0.0  # waiting in the (prefill) engine before first scheduled
    prefill_s: float = 0.0  # first scheduled -> first token computed
    ttft_s: float = 0.0  # request received -> first token sent
    decode_s: float = 0.0  # first token -> last token
    e2e_s: float = 0.0  # request received -> final message
    router_queue_s: float = 0.0  # waiting in the router before a worker took it
    kv_transfer_s: float = 0.0  # first KV byte sent -> last KV byte received
    kv_transfer_bytes: int = 0
    kv_transfer_hidden_s: float = 0.0  # part of kv_transfer_s overlapped with prefill
    decode_queue_s: float = 0.0  # decode request received -> first decode step

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


@dataclass(slots=True)
class RequestRecord:
    """What one request measured, client side, plus the server's own timings if any."""

    run: str  # label of the run this request belongs to (one per rate in a sweep)
    index: int  # position in the workload
    request_id: str
    kind: str
    prompt_tokens: int  # prompt length sent
    max_tokens: int  # output length asked for
    scheduled_s: float  # when it was due, seconds after the run started
    warmup: bool = False  # sent during warm-up: kept in the files, left out of the metrics
    send_time: float = 0.0  # epoch seconds when the request was sent
    # Receive time of every streamed chunk that carried output, seconds after send_time,
    # and how many tokens each carried (0 where the protocol does not say).
    chunk_offsets: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    e2e_s: float | None = None  # send -> final message (or -> the error when it failed)
    output_tokens: int = 0  # completion tokens, from the server's usage when it sends one
    cached_tokens: int = 0  # prompt tokens the server served from its prefix cache
    finish_reason: str = ""
    ok: bool = False
    error_code: str = ""  # gRPC status name or "HTTP <code>" or a client-side reason
    error_message: str = ""
    server: ServerTimings | None = None
    generator: str = ""  # which load-generator process sent it (host:pid)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_offsets[0] if self.chunk_offsets else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        data = dict(data)
        server = data.pop("server", None)
        known = {f.name for f in dataclasses.fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in known})
        if server is not None:
            names = set(ServerTimings.field_names())
            record.server = ServerTimings(**{k: v for k, v in server.items() if k in names})
        return record
