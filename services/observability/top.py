"""`pdserve top`: a live terminal view of a running stack, refreshed every second from
the registry in Redis and each worker's Prometheus endpoint (`fleet`).

    pdserve top                                # the local `pdserve up` stack
    pdserve top --redis-url redis://:pw@127.0.0.1:6379/0 --once --json

Through a Kubernetes port-forward (see docs/observability.md): forward the release's
Redis, and each worker's metrics port with `--metrics WORKER=127.0.0.1:PORT`; workers
without a reachable metrics port keep their Redis columns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from services.observability.fleet import Fleet, PrefixIndex, Row, Snapshot
from services.registry.local_stack import LocalStack, read_state
from services.registry.registry import Registry
from services.registry.signing import SECRET_ENV, SECRET_FILE_ENV, RecordSigner, load_secret
from services.security.redaction import redact_url

DESCRIPTION = (
    "A live view of a running stack, refreshed every --interval seconds: per worker "
    "its role, model, host, metrics address, when it (re)started, queue, running "
    "requests, KV cache use (from "
    "its record in Redis), prompt and generated tokens/s, KV GB/s received, "
    "errors (failed KV transfers, requests vLLM ended with an error) and "
    "migrations (from --router-metrics), from its Prometheus endpoint; whether it "
    "publishes its KV cache events; per router, the prefix index it routes on "
    "(precise: the engines' KV events; approximate: where prompts were sent) and the "
    "cache hit rate per pool. Works "
    "against `pdserve up` and, through port-forwards, a Helm release "
    "(docs/observability.md)."
)
COLUMNS = (
    "worker",
    "role",
    "model",
    "TP",
    "host",
    "metrics",
    "started",
    "queue",
    "running",
    "KV use",
    "KV events",
    "in tok/s",
    "out tok/s",
    "KV GB/s",
    "errors",
    "migrations",
    "heartbeat",
)
LEFT = ("worker", "role", "model", "host", "metrics")


def _num(value: float | int | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def age(seconds: float) -> str:
    """A duration as people read it: 42s, 12m05s, 3h04m, 2d03h."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def started(row: Row) -> str:
    """When the worker (re)started, as an age; the raw epoch when it is no time (the
    raw value is always in --json)."""
    return str(row.epoch) if row.started_age_s is None else f"{age(row.started_age_s)} ago"


def cells(row: Row) -> list[str]:
    """One worker's row as text (unknown figures as "-")."""
    return [
        row.worker_id,
        row.role,
        row.model or "-",
        str(row.tp),
        row.host,
        row.metrics_address or "-",
        started(row),
        str(row.queue),
        f"{row.running}/{row.capacity}",
        f"{row.kv_usage * 100:.1f}%",
        "on" if row.kv_events else "off",
        _num(row.prompt_tokens_per_s),
        _num(row.generation_tokens_per_s),
        _num(row.kv_gbytes_per_s, 3),
        _num(row.errors),
        _num(row.migrations),
        f"{row.heartbeat_age_s:.1f}s ago",
    ]


def index_note(index: PrefixIndex | None) -> str:
    """A router's prefix index as read: ", prefix index precise, cache hits prefill
    42.0% decode 30.5%" ("" when the router's page does not say)."""
    if index is None or not index.mode:
        return ""
    rates = " ".join(f"{pool} {rate * 100:.1f}%" for pool, rate in index.hit_rate.items())
    return f", prefix index {index.mode}" + (f", cache hits {rates}" if rates else "")


def render(snap: Snapshot, source: str, problem: str = "") -> Any:
    """A rich Table of the snapshot (a renderable for Live or Console.print)."""
    from rich.table import Table

    when = time.strftime("%H:%M:%S", time.localtime(snap.taken_at))
    table = Table(
        title=f"pdserve top: {len(snap.rows)} workers, {source}, {when}",
        title_justify="left",
        expand=False,
    )
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in LEFT else "right", no_wrap=True)
    for row in snap.rows:
        style = "" if row.metrics else "dim"
        table.add_row(*cells(row), style=style)
    notes = []
    if any(not r.metrics for r in snap.rows):
        notes.append("dim rows: metrics not reachable (Redis figures only; see --metrics)")
    for address, total in snap.routers.items():
        notes.append(
            f"router {address}: "
            + ("metrics not reachable" if total is None else f"{total:.0f} migrations")
            + index_note(snap.prefix_index.get(address))
        )
    if problem:
        notes.append(problem)
    table.caption = "\n".join(notes) or None
    table.caption_justify = "left"
    return table


UNSIGNED_NOTE = (
    "no cluster secret: records are read without checking their signatures "
    f"(pass --cluster-secret-file, or set {SECRET_FILE_ENV} or {SECRET_ENV} to "
    "the stack's secret)"
)


@dataclass(frozen=True)
class Source:
    """Which stack top reads, and how."""

    redis_url: str
    signer: RecordSigner
    routers: list[str]  # router metrics endpoints
    note: str = ""  # shown under the table (the signatures not checked)


def source(args: argparse.Namespace) -> Source:
    """--redis-url, else $PDSERVE_REDIS_URL, else the local `pdserve up` stack's Redis.
    The cluster secret: --cluster-secret-file, else $PDSERVE_CLUSTER_SECRET(_FILE), else
    the local stack's when its Redis is the one read. The routers: --router-metrics,
    else the local stack's."""
    local: LocalStack | None = read_state()
    url = args.redis_url or os.environ.get("PDSERVE_REDIS_URL", "")
    if not url:
        if local is None:
            raise RuntimeError(
                "no local pdserve stack found (`pdserve up` writes where its "
                "Redis is); pass --redis-url"
            )
        url = local.redis_url
    mine = local if local is not None and local.redis_url == url else None
    key = (
        load_secret("", args.cluster_secret_file)
        if args.cluster_secret_file
        else load_secret(os.environ.get(SECRET_ENV, ""), os.environ.get(SECRET_FILE_ENV, ""))
    )
    if key is None and mine is not None and mine.cluster_secret:
        key = mine.cluster_secret.encode()
    routers = args.router_metrics or list(mine.router_metrics if mine else ())
    return Source(url, RecordSigner(key), routers, "" if key else UNSIGNED_NOTE)


def overrides(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        worker, sep, address = pair.partition("=")
        if not sep or not worker or ":" not in address:
            raise ValueError(f"--metrics {pair!r}: expected WORKER=HOST:PORT")
        out[worker] = address
    return out


async def run(args: argparse.Namespace) -> int:
    src = source(args)
    registry = Registry.from_url(src.redis_url, signer=src.signer, prefix=args.prefix)
    fleet = Fleet(registry, overrides(args.metrics), src.routers)
    where = f"Redis {redact_url(src.redis_url)}"
    if src.note and args.once and args.json:  # else it is under the table
        print(f"note: {src.note}", file=sys.stderr)
    try:
        if args.once:
            await fleet.snapshot()  # rates need two scrapes, `interval` apart
            await asyncio.sleep(args.interval)
            snap = await fleet.snapshot()
            if args.json:
                print(json.dumps(snap.to_dict(), indent=2))
            else:
                from rich.console import Console

                # Piped into a script or a file: the whole row, never cut to 80 columns.
                Console(width=None if sys.stdout.isatty() else 260).print(
                    render(snap, where, src.note)
                )
            return 0
        await live(fleet, where, args.interval, src.note)
        return 0
    finally:
        await registry.close()


async def live(fleet: Fleet, source: str, interval: float, note: str = "") -> None:
    """Redraw every `interval` seconds until Ctrl-C; a lost Redis is shown, not fatal."""
    from rich.console import Console
    from rich.live import Live

    snap, problem = Snapshot([]), ""
    with Live(render(snap, source), console=Console(), auto_refresh=False) as view:
        while True:
            try:
                snap, problem = await fleet.snapshot(), note
            except Exception as e:  # Redis away: keep the last rows, say why, retry
                problem = f"registry not readable: {type(e).__name__}: {e}"
            view.update(render(snap, source, problem), refresh=True)
            await asyncio.sleep(interval)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        default="",
        help="the stack's Redis (redis:// or "
        "rediss://, password in the URL); default: $PDSERVE_REDIS_URL, else the "
        "local `pdserve up` stack's",
    )
    p.add_argument(
        "--cluster-secret-file",
        default="",
        help="the stack's cluster secret, "
        "to check the records' signatures; default: $PDSERVE_CLUSTER_SECRET(_FILE), "
        "else the local `pdserve up` stack's when its Redis is the one read",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between refreshes; "
        "with --once, between the two scrapes the rates come from (default 1)",
    )
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument(
        "--json",
        action="store_true",
        help="with --once: one JSON object (rates null when unknown) instead of a table",
    )
    p.add_argument(
        "--metrics",
        action="append",
        default=[],
        metavar="WORKER=HOST:PORT",
        help="read this worker's metrics at HOST:PORT (a port-forward) instead of "
        "its registered address and metrics port (repeatable)",
    )
    p.add_argument(
        "--router-metrics",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a router's metrics endpoint: migrations per worker come from there "
        "(repeatable); default: the local `pdserve up` stack's router",
    )
    p.add_argument("--prefix", default="pdserve:", help="the registry's Redis key prefix")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `pdserve top` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "top",
        help="a live view of a running stack: per worker its role, host, epoch, "
        "queue, running requests, KV usage, tokens/s, KV GB/s, errors and migrations",
        description=DESCRIPTION,
    )
    flags(p)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("error: --interval must be positive", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # Redis errors: the URL is wrong or Redis is down
        print(f"error: cannot read the registry: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pdserve top", description=DESCRIPTION)
    flags(parser)
    sys.exit(main(parser.parse_args()))
