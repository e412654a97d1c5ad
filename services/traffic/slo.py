"""``SLOs``: the per-request latency bounds goodput counts against.

A request meets the SLOs when it completed and every given bound holds. Bounds are
inclusive; a TPOT bound does not apply to one-token outputs (they have no TPOT); the ITL
bound applies to the request's largest chunk gap.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.traffic.latency import itls, tpot
from services.traffic.record import RequestRecord

SLO_NAMES = ("ttft", "tpot", "itl", "e2e")


@dataclass(slots=True, frozen=True)
class SLOs:
    """Per-request latency bounds in seconds; None means no bound."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: float | None = None  # bound on the request's largest chunk gap
    e2e_s: float | None = None

    def as_dict(self) -> dict[str, float]:
        pairs = (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("itl", self.itl_s),
                 ("e2e", self.e2e_s))
        return {k: v for k, v in pairs if v is not None}

    def met(self, rec: RequestRecord) -> bool:
        if not rec.ok:
            return False
        checks = (
            (self.ttft_s, rec.ttft_s),
            (self.tpot_s, tpot(rec)),
            (self.itl_s, max(itls(rec), default=None)),
            (self.e2e_s, rec.e2e_s),
        )
        return all(bound is None or value is None or value <= bound for bound, value in checks)


def parse_slos(items: list[str]) -> SLOs:
    """SLOs from ``NAME=SECONDS`` items (each may hold several, comma-separated)."""
    bounds: dict[str, float] = {}
    for item in (part for text in items for part in text.split(",") if part):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in SLO_NAMES:
            raise ValueError(f"bad SLO {item!r}: use NAME=SECONDS with NAME in {SLO_NAMES}")
        bounds[f"{name.strip()}_s"] = float(value)
    return SLOs(**bounds)
