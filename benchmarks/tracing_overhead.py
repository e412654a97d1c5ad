"""What tracing costs per request, off and on.

`micro`: the tracing calls one routed request makes, timed in a tight loop: the
router's (the client's context extracted, the router span with its events, trace
context on the prefill and decode calls) and the workers' (the prefill span, the decode
span, the KV transfer span). With tracing off (the default), and on with the real
OTLP/gRPC exporter sending every span to a real OTLP receiver in another process (its
CPU counted). Reported as CPU time per request, next to the router's own per-request
cost (BENCHMARKS.md, router overhead).

    python benchmarks/tracing_overhead.py micro --json bench-results/tracing_micro.json

`router`: benchmarks/router_overhead.py (the real `pdserve router`, one core, over
simulated workers registered in a real redis-server) run alternately with tracing off
and with every request traced to a real OTLP receiver (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
sampling ratio 1), the same commands, in one run; medians of the repeats, and on/off.

    python benchmarks/tracing_overhead.py router --json bench-results/tracing_router.json \
        --plot docs/benchmarks/tracing_overhead.png
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.observability import tracing  # noqa: E402
from services.observability.request_spans import (  # noqa: E402
    TransferFacts,
    decode_span,
    prefill_span,
    record_kv_transfer,
    router_span,
)

CLIENT = [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
          ("user-agent", "grpc-python")]


TIMINGS = {"queue_s": 0.01, "prefill_s": 0.2, "decode_s": 0.5}


def router_calls(tokens: int) -> None:
    """The router's tracing calls for one request (the workers' come with their own
    `traceparent`, as the metadata would carry it)."""
    root = router_span("req", 1000, tokens, "m", tracing.extract_grpc(CLIENT), 0.0, 1.0)
    root.admitted(1)
    root.pair(0, "prefill-a", "decode-a", "load")
    root.grpc_metadata()
    root.first_token(0.21)
    root.grpc_metadata()
    root.finish("length", tokens, TIMINGS, 0.8)
    root.end()


def worker_calls(tokens: int) -> None:
    """The prefill and decode workers' calls for one request (KV transfer included)."""
    p = prefill_span("req", 1000, "prefill-a", 1, tracing.extract_grpc(CLIENT))
    p.done(0.01, 0.2, 0, 1000.3, 1000.0)
    p.end()
    d_parent = tracing.extract_grpc(CLIENT)
    d = decode_span("req", 1000, "decode-a", 1, d_parent, local_prefill=False)
    if d:  # as the decode worker does: the facts are built only for a recording span
        record_kv_transfer(d_parent, TransferFacts("t", "grpc", True, 3 << 20, 1000.1,
                                                   1000.16, 0.04, "prefill-a", "decode-a"))
    d.done(0.01, 0.0, tokens - 1, tokens - 1, "length", 0.5)
    d.end()


def timed(calls: Any, n: int, tokens: int, flush: bool = False) -> float:
    """CPU seconds (this process, exporter thread included) per request over n; with
    `flush`, the export of what they made is inside the measurement."""
    t0 = time.process_time()
    for _ in range(n):
        calls(tokens)
    if flush:
        tracing.force_flush(60.0)
    return (time.process_time() - t0) / n


def empty_loop(n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        pass
    return (time.process_time() - t0) / n


def receiver_process(ready: Any, stop: Any) -> None:
    from tests.helpers.otlp_receiver import OtlpReceiver

    r = OtlpReceiver().start()
    ready.put(r.endpoint)
    stop.wait()
    ready.put(len(r.spans))
    r.stop()


def micro(args: argparse.Namespace) -> dict[str, Any]:
    # Every span is exported (no drops), so "on" includes the exporter's CPU.
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(args.requests * 4)
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=receiver_process, args=(ready, stop), daemon=True)
    proc.start()
    endpoint = ready.get(timeout=60)
    samples: dict[str, list[float]] = {}
    made = 0
    # Interleaved rounds, so drift on a shared machine hits both sides alike.
    for _ in range(args.rounds):
        samples.setdefault("empty_loop", []).append(empty_loop(args.requests))
        for name, calls in (("router", router_calls), ("workers", worker_calls)):
            tracing.shutdown_tracing()
            samples.setdefault(f"{name}_off", []).append(timed(calls, args.requests,
                                                               args.tokens))
            tracing.setup_tracing("pdserve-bench", endpoint, 1.0)
            n = args.requests // 10
            samples.setdefault(f"{name}_on", []).append(timed(calls, n, args.tokens, True))
            made += n * (1 if name == "router" else 3)
    tracing.shutdown_tracing()
    stop.set()
    received = ready.get(timeout=60)
    proc.join(10)
    result: dict[str, Any] = {"requests_per_round": args.requests, "rounds": args.rounds,
                              "tokens_per_request": args.tokens, "spans_made": made,
                              "spans_received": received}
    for name, values in samples.items():
        result[f"{name}_us_per_request"] = statistics.median(values) * 1e6
    return result


def router(args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/router_overhead.py (the real router over simulated workers in a real
    redis-server), run alternately with tracing off and on, in this one run."""
    import subprocess

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=receiver_process, args=(ready, stop), daemon=True)
    proc.start()
    endpoint = ready.get(timeout=60)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for i in range(args.repeats):
        for mode in ("off", "on"):
            env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
            # Unsigned records, as the router benchmark's plain mode: its simulated workers
            # write records without heartbeat times, which signed reads refuse as stale.
            env["PDSERVE_CLUSTER_SECRET"] = ""
            env["PDSERVE_ALLOW_UNSIGNED_RECORDS"] = "true"
            if mode == "on":
                env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint
            path = out / f"router-{mode}-{i}.json"
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "router_overhead.py"),
                            "--rounds", str(args.rounds), "--seconds", str(args.seconds),
                            "--json", str(path)], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            runs[mode].append(json.loads(path.read_text()))
    stop.set()
    received = ready.get(timeout=60)
    proc.join(10)

    def med(mode: str, part: str, key: str) -> float:
        return float(statistics.median(r[part][key] for r in runs[mode]))

    figures = [("latency", "ttft_added_p50_ms"), ("latency", "ttft_added_p99_ms"),
               ("latency", "e2e_added_p50_ms"), ("capacity_short", "requests_per_router_core_s"),
               ("capacity_stream", "tokens_per_router_core_s")]
    result: dict[str, Any] = {"repeats": args.repeats, "spans_received": received}
    for part, key in figures:
        off, on = med("off", part, key), med("on", part, key)
        result[key] = {"off": off, "on": on, "on_over_off": on / off if off else None}
    return result


def plot(summary: dict[str, Any], path: str) -> None:
    """on/off of each router figure as bars (1.0 = tracing costs nothing there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"ttft_added_p50_ms": "TTFT added\np50", "ttft_added_p99_ms": "TTFT added\np99",
              "e2e_added_p50_ms": "E2E added\np50",
              "requests_per_router_core_s": "requests/s\nper core",
              "tokens_per_router_core_s": "tokens/s\nper core"}
    keys = [k for k in labels if isinstance(summary.get(k), dict)]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.bar(range(len(keys)), [summary[k]["on_over_off"] or 0 for k in keys], 0.6)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(keys)), [labels[k] for k in keys], fontsize=8)
    ax.set_ylabel("tracing on / off")
    ax.set_title("Router with every request traced (OTLP/gRPC) vs tracing off")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("micro", help="the tracing calls of one request, off vs on")
    m.add_argument("--requests", type=int, default=20000, help="requests per round (off)")
    m.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    m.add_argument("--tokens", type=int, default=16, help="tokens per request")
    m.add_argument("--json", default="", help="write the summary here as JSON")
    r = sub.add_parser("router", help="the router benchmark, tracing off vs on")
    r.add_argument("--repeats", type=int, default=2, help="off/on pairs")
    r.add_argument("--rounds", type=int, default=200, help="latency: measured requests")
    r.add_argument("--seconds", type=float, default=8.0, help="capacity: run length")
    r.add_argument("--out", default="bench-results/tracing-router", help="per-run JSON here")
    r.add_argument("--json", default="", help="write the summary here as JSON")
    r.add_argument("--plot", default="", help="write a PNG of on/off per figure here")
    args = parser.parse_args()
    summary = micro(args) if args.mode == "micro" else router(args)
    if args.mode == "router" and args.plot:
        plot(summary, args.plot)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
