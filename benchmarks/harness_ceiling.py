"""The load-testing harness's own ceiling: how much one client process can drive.

Starts the SIMULATED servers of ``services.bench.simulator`` (a gRPC one and an
OpenAI-compatible SSE one), each in its own process, and runs the harness against them
with no pacing (tokens as fast as the simulator can send) at several concurrencies:

- ``short``: one output token per request: the request-rate ceiling.
- ``stream``: long outputs, one token per chunk: the streamed-token (chunk) ceiling.
- ``paced``: the simulator paces tokens at --pace-s; how far the measured TPOT and ITL
  drift from that pace shows the harness's timing error at that load.

Client and simulator share the machine's cores: where client CPU stays well under 100%,
the simulator (or other load) was the limit and req/s, tokens/s are lower bounds. The
per-CPU-second columns (work done per second of the client's CPU time) estimate what a
client with one whole core to itself drives either way.

A server measured with the harness is harness-bound, not server-bound, when it comes
near these numbers; run more generator processes then. Client CPU is the harness
process's CPU time over wall time (100% = one core busy).

    python benchmarks/harness_ceiling.py --json-out bench-results/harness_ceiling.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]  # runnable from a plain checkout too

from services.bench.runner import Runner  # noqa: E402
from services.bench.targets import GrpcTarget, OpenAITarget, Target  # noqa: E402
from services.traffic.arrivals import ArrivalConfig  # noqa: E402
from services.traffic.summary import summarize  # noqa: E402
from services.traffic.workload import LengthDist, WorkloadConfig, build_workload  # noqa: E402


@contextmanager
def simulator(protocol: str, pace_s: float) -> Iterator[int]:
    """A SIMULATED server in its own process; yields its port."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "proto"), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.bench.simulator", "--protocol", protocol,
         "--port", "0", "--tpot-s", str(pace_s)],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"simulator did not start: {line!r}")
        yield int(line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def make_target(protocol: str, port: int) -> Target:
    if protocol == "grpc":
        return GrpcTarget(f"127.0.0.1:{port}", timeout_s=120)
    return OpenAITarget(f"http://127.0.0.1:{port}", timeout_s=120)


async def measure(protocol: str, port: int, concurrency: int, requests: int,
                  output_len: int) -> dict[str, Any]:
    specs = build_workload(WorkloadConfig(
        num_requests=min(requests, 1000), input_len=LengthDist(128),
        output_len=LengthDist(output_len), vocab_size=1000), None)
    target = make_target(protocol, port)
    await target.start()
    try:
        runner = Runner(target, progress=False)
        cpu0 = time.process_time()
        result = await runner.run(specs, ArrivalConfig(max_concurrency=concurrency),
                                  "ceiling", requests)
        cpu = time.process_time() - cpu0
    finally:
        await target.close()
    s = summarize(result.records)
    return {
        "requests": s["requests"], "failed": s["failed"], "wall_s": result.wall_s,
        "request_throughput": s["request_throughput"],
        "output_token_throughput": s["output_token_throughput"],
        "client_cpu_share": cpu / result.wall_s,
        # Throughput per second of client CPU: what one fully busy core would drive, which
        # holds even where the simulator (or other load on the machine) was the limit.
        "requests_per_cpu_s": s["completed"] / cpu if cpu > 0 else None,
        "tokens_per_cpu_s": s["output_tokens"] / cpu if cpu > 0 else None,
        "tpot_mean_s": s["tpot_s"]["mean"], "itl_p50_s": s["itl_s"]["p50"],
        "itl_p99_s": s["itl_s"]["p99"], "ttft_p50_s": s["ttft_s"]["p50"],
    }


def scenarios(args: argparse.Namespace) -> list[tuple[str, int, int, float]]:
    """(scenario, output tokens, requests, simulator pace) per scenario."""
    out = [("short", 1, args.requests, 0.0), ("stream", args.stream_len,
                                                max(args.requests // 20, 20), 0.0)]
    if args.pace_s > 0:
        out.append(("paced", args.stream_len, max(args.requests // 20, 20), args.pace_s))
    return out


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("protocol", "protocol"), ("scenario", "scenario"), ("concurrency", "conc."),
            ("requests", "requests"), ("request_throughput", "req/s"),
            ("output_token_throughput", "tokens/s"), ("client_cpu_share", "client CPU"),
            ("requests_per_cpu_s", "req/CPU-s"), ("tokens_per_cpu_s", "tokens/CPU-s"),
            ("tpot_mean_s", "TPOT mean (s)"), ("itl_p99_s", "ITL p99 (s)")]
    lines = ["| " + " | ".join(h for _, h in cols) + " |",
             "|" + "|".join(" --- " for _ in cols) + "|"]
    for row in rows:
        cells = [f"{100 * row[k]:.0f}%" if k == "client_cpu_share" else fmt(row[k])
                 for k, _ in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Measure the bench harness's own ceiling (requests/s and tokens/s one "
        "client process drives) against SIMULATED servers on 127.0.0.1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--protocols", nargs="+", choices=("grpc", "openai"),
                   default=["grpc", "openai"], help="targets to measure")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64],
                   help="requests in flight (a closed loop per value)")
    p.add_argument("--requests", type=int, default=2000,
                   help="requests in the 'short' scenario (streams: 1/20 of it, >= 20)")
    p.add_argument("--stream-len", type=int, default=256,
                   help="output tokens per request in the 'stream' and 'paced' scenarios")
    p.add_argument("--pace-s", type=float, default=0.01,
                   help="simulator token pace of the 'paced' scenario; 0 skips it")
    p.add_argument("--json-out", type=Path, default=Path("bench-results/harness_ceiling.json"),
                   help="where the JSON results go")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for protocol in args.protocols:
        for scenario, out_len, requests, pace in scenarios(args):
            with simulator(protocol, pace) as port:
                for conc in args.concurrency:
                    row = {"protocol": protocol, "scenario": scenario, "concurrency": conc,
                           "output_len": out_len, "pace_s": pace}
                    row.update(asyncio.run(measure(protocol, port, conc, requests, out_len)))
                    rows.append(row)
                    print(f"{protocol} {scenario} c={conc}: {row['request_throughput']:.0f} "
                          f"req/s, {row['output_token_throughput']:.0f} tokens/s",
                          file=sys.stderr, flush=True)
    print(table(rows))
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows}, indent=2) + "\n")
    print(f"\nJSON: {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
