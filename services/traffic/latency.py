"""Latency of one request, from its record: no I/O, no clocks.

Definitions (docs: conventions.md, "Latency metrics"):

- TTFT: request sent -> first chunk received (``RequestRecord.ttft_s``).
- TPOT, per request: (E2E - TTFT) / (output_tokens - 1); one-token outputs have none.
- ITL: every gap between successive received chunks. (AIPerf calls the per-request mean
  "ITL" and this per-chunk gap "ICL".)
- E2E: request sent -> final message (``RequestRecord.e2e_s``).
- Anatomy: where the E2E went, from the server's own timings.
"""

from __future__ import annotations

import itertools

from services.traffic.record import RequestRecord

# The anatomy of a request, in the order its parts happen. The parts add up to the
# client's E2E exactly; "other" parts are what the server's fields do not name.
ANATOMY_SEGMENTS = (
    "router_queue",  # waiting in the router
    "prefill_queue",  # waiting in the prefill engine
    "prefill",  # prefill compute, up to the first token
    "first_token_other",  # server TTFT not covered by the three above
    "kv_transfer",  # KV transfer not hidden behind prefill compute
    "decode_queue",  # waiting for the first decode step
    "decode",  # decode steps: server decode time less the two above
    "server_other",  # server E2E after the last token (finishing, final message)
    "client_network",  # client E2E less server E2E: network, serialization, client
)


def output_tokens(rec: RequestRecord) -> int:
    """Completion tokens: the server's usage, else the tokens or chunks counted."""
    return rec.output_tokens or sum(rec.chunk_tokens) or len(rec.chunk_offsets)


def tpot(rec: RequestRecord) -> float | None:
    n = output_tokens(rec)
    if not rec.ok or n < 2 or rec.e2e_s is None or rec.ttft_s is None:
        return None
    return (rec.e2e_s - rec.ttft_s) / (n - 1)


def itls(rec: RequestRecord) -> list[float]:
    offsets = rec.chunk_offsets
    return [b - a for a, b in itertools.pairwise(offsets)]


def anatomy(rec: RequestRecord) -> dict[str, float] | None:
    """Where the request's client E2E went, per ``ANATOMY_SEGMENTS``; None without
    server timings. Residuals are kept signed so the parts sum to the E2E exactly."""
    t = rec.server
    if t is None or not rec.ok or rec.e2e_s is None:
        return None
    kv_exposed = max(0.0, t.kv_transfer_s - t.kv_transfer_hidden_s)
    parts = {
        "router_queue": t.router_queue_s,
        "prefill_queue": t.queue_s,
        "prefill": t.prefill_s,
        "first_token_other": t.ttft_s - t.router_queue_s - t.queue_s - t.prefill_s,
        "kv_transfer": kv_exposed,
        "decode_queue": t.decode_queue_s,
        "decode": t.decode_s - kv_exposed - t.decode_queue_s,
        "server_other": t.e2e_s - t.ttft_s - t.decode_s,
        "client_network": rec.e2e_s - t.e2e_s,
    }
    return parts
