"""`pdserve top`'s prefix index figures, read from a router's Prometheus page."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from services.observability.fleet import PrefixIndex, parse_prefix_index
from services.observability.top import index_note


def router_page(mode: str, routed: dict[str, float], cached: dict[str, float]) -> str:
    """A page with the router's own metric definitions' names and labels."""
    registry = CollectorRegistry()
    modes = Gauge("pdserve_router_prefix_index_mode", "m", ["mode"], registry=registry)
    for m in ("precise", "approximate", "mixed"):
        modes.labels(m).set(1 if m == mode else 0)
    r = Counter("pdserve_router_routed_prompt_tokens", "r", ["pool"], registry=registry)
    c = Counter("pdserve_router_cached_prompt_tokens", "c", ["pool"], registry=registry)
    for pool, n in routed.items():
        r.labels(pool).inc(n)
    for pool, n in cached.items():
        c.labels(pool).inc(n)
    return generate_latest(registry).decode()


def test_the_mode_and_the_hit_rate_per_pool_are_read() -> None:
    index = parse_prefix_index(router_page("precise", {"prefill": 1000, "decode": 400},
                                           {"prefill": 250, "decode": 100}))
    assert index == PrefixIndex("precise", {"decode": 0.25, "prefill": 0.25})
    assert index_note(index) == ", prefix index precise, cache hits decode 25.0% prefill 25.0%"


def test_a_pool_with_nothing_routed_has_no_rate_and_an_old_router_no_note() -> None:
    index = parse_prefix_index(router_page("approximate", {"prefill": 0}, {}))
    assert index == PrefixIndex("approximate", {})
    assert index_note(index) == ", prefix index approximate"
    assert index_note(parse_prefix_index("")) == "" and index_note(None) == ""
