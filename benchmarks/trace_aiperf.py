"""Do `pdserve bench` and NVIDIA AIPerf measure the same thing? The same Mooncake window
replayed against the same `pdserve up` stack's OpenAI front by both tools, runs
alternating, and their TTFT and ITL compared within the intervals of their runs.

The window is `benchmarks/trace_routing.py`'s (the same draw of conversations, rate and
length scaling), handed to AIPerf as a Mooncake trace of its own: each request's send
time, scaled lengths and the trace's hash ids of the blocks it uses, with AIPerf's block
size set to the replay's (`--isl-block-size`), so both tools send the same prefix
structure at the same times. AIPerf's prompts are its own text; `pdserve bench` sends
token ids. AIPerf has no turn order for a Mooncake trace (every request leaves at its
time), so `pdserve bench` runs with `--no-turn-order` here. Each run of either tool uses
fresh prompt content (its seed + k), so no run finds another's prefixes cached.

Compared, as the two tools define them:
  * TTFT: both, per request; the p50 and the mean over the window's requests;
  * ITL: AIPerf's `inter_token_latency` is per request (last content chunk - first token)
    / (output tokens - 1), which is `pdserve bench`'s TPOT; its p50 and mean. Both count
    output tokens from the server's usage (AIPerf with `--use-server-token-count`; by
    default it re-tokenizes the streamed text, which can differ from the server's count).
They agree when the two tools' intervals over their runs overlap.

Both tools stamp a streamed event with the time their client read it off the socket
(AIPerf: the time of the network read the event arrived in), so a client that reads
late sees TTFT late and several events at once, and its ITL shrinks (to 0 for a request
read whole in one read). AIPerf is several processes where `pdserve bench` is one, and
on a small host shared with busy engines it can fall seconds behind, which it reports
itself: the lag of its sends behind the schedule and its event loops' stalls. Both are
kept with each run (with `pdserve bench`'s own send lag), with the requests each tool
completed, so a disagreement can be told from a client that was not keeping up. AIPerf
runs with the fewest processes it allows (one worker and one record processor, no
server-metrics or GPU-telemetry collectors). On a host whose cores the engines keep busy
(CPU engines do), an ordinary-priority client can wait seconds for a core, whichever the
tool; `--client-priority` runs both tools' clients at a real-time priority, as
`services/bench/netdelay.py` runs its delayer for the same reason.

AIPerf is installed in a virtual environment of its own (it pins other versions of the
libraries pdserve uses) and named with --aiperf:

    python -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf
    python benchmarks/trace_aiperf.py --aiperf /tmp/aiperf/bin/aiperf \\
        --trace ../shared/traces/mooncake_conversation.jsonl --conversations 6 \\
        --trace-rate 0.5 --runs 3 --client-priority 1 --json bench-results/trace_aiperf.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.traffic.intervals import interval  # noqa: E402
from services.traffic.traces import (  # noqa: E402
    ReplayConfig,
    plan_replay,
    read_trace,
    sample_conversations,
    window,
)

# (figure, AIPerf metric and statistic, pdserve bench summary key and statistic)
FIGURES = (("ttft_p50_s", ("time_to_first_token", "p50"), ("ttft_s", "p50")),
           ("ttft_mean_s", ("time_to_first_token", "avg"), ("ttft_s", "mean")),
           ("itl_p50_s", ("inter_token_latency", "p50"), ("tpot_s", "p50")),
           ("itl_mean_s", ("inter_token_latency", "avg"), ("tpot_s", "mean")))
PARTIAL_BLOCK_IDS = 1 << 40  # above every hash id of the trace
UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "us": 1e-6, "ns": 1e-9}  # AIPerf's, to seconds


def aiperf_trace(args: argparse.Namespace) -> tuple[list[dict[str, Any]], int]:
    """The replay's requests as Mooncake trace lines for AIPerf, and the block size."""
    cfg = ReplayConfig(path=args.trace, rate=args.trace_rate,
                       max_model_len=args.max_model_len,
                       conversations=args.conversations, seed=args.seed,
                       sample_seed=args.seed)
    trace = read_trace(args.trace)
    replay = plan_replay(cfg, np.arange(1000), trace)
    records = sample_conversations(window(trace.records), args.conversations, args.seed)
    block = replay.lengths.block_tokens
    lines = []
    for k, (spec, rec) in enumerate(zip(replay.specs, records, strict=True)):
        n = len(spec.prompt_ids)
        ids = list(rec.hash_ids[:math.ceil(n / block)])
        if n % block:
            # AIPerf gives a hash id one block of one size: a prompt's partial last block
            # gets an id of its own (no engine caches a partial block anyway).
            ids[-1] = PARTIAL_BLOCK_IDS + k
        lines.append({"timestamp": round(1000 * (spec.at_s or 0.0)), "input_length": n,
                      "output_length": spec.output_len, "hash_ids": ids})
    return lines, block


def local_hub(folder: Path, hub: Path) -> tuple[str, Path]:
    """A model hub cache holding `folder` as the snapshot of a repo id, and that id.
    AIPerf's offline mode looks tokenizers up by repo id in the hub cache only (a folder
    path is taken for a malformed id), so the served model's own tokenizer is handed to it
    as a cached repo: links to the folder's files, nothing copied or fetched."""
    repo = f"local/{folder.name}"
    root = hub / f"models--local--{folder.name}"
    snapshot = root / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text("local")
    for f in folder.iterdir():
        link = snapshot / f.name
        if f.is_file() and not link.exists():
            link.symlink_to(f.resolve())
    return repo, hub


def run_aiperf(args: argparse.Namespace, base_url: str, trace_file: Path, block: int,
               out: Path, seed: int, tokenizer: str) -> dict[str, float]:
    repo, hub = local_hub(Path(tokenizer), out.parent / "hub")
    cmd = [args.aiperf, "profile", "--url", base_url, "--endpoint-type", "completions",
           "--streaming", "--model", args.model, "--tokenizer", repo,
           "--input-file", str(trace_file), "--custom-dataset-type", "mooncake-trace",
           "--fixed-schedule", "--fixed-schedule-auto-offset", "--isl-block-size", str(block),
           "--extra-inputs", json.dumps({"ignore_eos": True}), "--random-seed", str(seed),
           "--use-server-token-count", "--workers-max", "1", "--record-processors", "1",
           "--no-server-metrics", "--no-gpu-telemetry",
           "--ui-type", "none", "--artifact-dir", str(out)]
    # The tokenizer is a local folder: nothing needs the model hub.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_CACHE": str(hub)}
    with (out.parent / f"{out.name}.log").open("wb") as log:
        subprocess.run(prioritized(args, cmd), check=True, stdout=log,
                       stderr=subprocess.STDOUT, cwd=ROOT, timeout=args.run_timeout, env=env)
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"AIPerf wrote no profile_export_aiperf.json under {out}")
    doc = json.loads(found[-1].read_text())
    figures = {}
    for name, (metric, stat), _ in FIGURES:
        entry = doc.get(metric)
        if not entry or entry.get(stat) is None or entry.get("unit") not in UNITS:
            raise RuntimeError(f"{found[-1]}: no {metric} {stat} in a known unit: {entry}")
        figures[name] = float(entry[stat]) * UNITS[entry["unit"]]
    log = (out.parent / f"{out.name}.log").read_text(errors="replace")
    return {**figures, "completed": aiperf_count(doc, "request_count"),
            "failed": aiperf_count(doc, "error_request_count"),
            "send_lag_p90_s": aiperf_seconds(doc, "replay_sched_lag_p90"),
            "client_stall_max_s": worker_stall_s(log)}


def aiperf_count(doc: dict[str, Any], metric: str) -> int:
    entry = doc.get(metric) or {}  # AIPerf leaves a count out when it is zero
    return int(entry.get("avg") or 0)


def aiperf_seconds(doc: dict[str, Any], metric: str) -> float:
    entry = doc.get(metric) or {}
    if entry.get("avg") is None or entry.get("unit") not in UNITS:
        return math.nan
    return float(entry["avg"]) * UNITS[entry["unit"]]


STALL = re.compile(r"Event loop for (\S+) is taking too long to run\. "
                   r"Overhead: ([\d,.]+)ms")


def worker_stall_s(log: str) -> float:
    """The longest stall AIPerf logged of one of its event loops: its timing manager's
    delays sends, its worker's the stamping of every event that arrives meanwhile."""
    return max((float(m[2].replace(",", "")) / 1e3 for m in STALL.finditer(log)),
               default=0.0)


def prioritized(args: argparse.Namespace, cmd: list[str]) -> list[str]:
    """`cmd` at real-time priority when asked (its children inherit it), as both tools'
    clients must be for their stamps to be the server's timing, not the host's."""
    return ["chrt", "--fifo", str(args.client_priority), *cmd] if args.client_priority else cmd


def run_bench(args: argparse.Namespace, base_url: str, out: Path, seed: int,
              tokenizer: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "services.cli", "bench", "run", "--target", "openai",
           "--base-url", base_url, "--model", args.model, "--tokenizer", tokenizer,
           "--trace", args.trace, "--trace-conversations", str(args.conversations),
           "--trace-sample-seed", str(args.seed), "--trace-rate", str(args.trace_rate),
           "--max-model-len", str(args.max_model_len), "--no-turn-order",
           "--seed", str(seed), "--output-dir", str(out), "--no-plots", "--no-progress"]
    subprocess.run(prioritized(args, cmd), check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   timeout=args.run_timeout)
    summary = json.loads((out / "summary.json").read_text())["runs"][0]
    lags = []
    for line in (out / "requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("send_time") is not None and rec.get("scheduled_s") is not None:
            lags.append(rec["send_time"] - summary["started_at"] - rec["scheduled_s"])
    return {**{name: float(summary[key][stat]) for name, _, (key, stat) in FIGURES},
            "completed": int(summary["completed"]), "failed": int(summary["failed"]),
            "send_lag_p90_s": float(np.percentile(lags, 90)) if lags else math.nan}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from services.bench.upstack import UpStack
    from services.engine.model import resolve_model
    from services.server.channels import free_port

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lines, block = aiperf_trace(args)
    trace_file = workdir / "window.jsonl"
    trace_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tokenizer = str(resolve_model("", "float32"))
    http = free_port()
    stack = UpStack(workdir / "stack", ["--http-port", str(http), "--max-model-len",
                                        str(args.max_model_len), "--kv-cache-gib",
                                        str(args.kv_cache_gib)],
                    prefill=args.prefill, decode=args.decode)
    base_url = f"http://127.0.0.1:{http}"
    runs: dict[str, list[dict[str, float]]] = {"pdserve_bench": [], "aiperf": []}
    stack.start()
    try:
        await stack.wait_ready(timeout=900, workers=args.prefill + args.decode)
        if not args.model:
            from services.api.client import PdserveClient

            async with PdserveClient(stack.address) as client:
                args.model = (await client.model_info()).model
        for k in range(args.runs):  # alternating, so drift of the machine hits both
            seed = args.seed + 1000 * (k + 1)
            runs["pdserve_bench"].append(await asyncio.to_thread(
                run_bench, args, base_url, workdir / f"bench-{k + 1}", seed, tokenizer))
            runs["aiperf"].append(await asyncio.to_thread(
                run_aiperf, args, base_url, trace_file, block, workdir / f"aiperf-{k + 1}",
                seed, tokenizer))
    finally:
        await stack.close()
    rows = {}
    for name, _, _ in FIGURES:
        ours = interval([r[name] for r in runs["pdserve_bench"]], args.confidence_level)
        theirs = interval([r[name] for r in runs["aiperf"]], args.confidence_level)
        rows[name] = {"pdserve_bench": ours.as_dict(), "aiperf": theirs.as_dict(),
                      "agree": ours.overlaps(theirs)}
    return {"trace": args.trace, "conversations": args.conversations,
            "requests": len(lines), "block_tokens": block, "runs": args.runs,
            "confidence_level": args.confidence_level, "rows": rows, "per_run": runs}


def print_table(result: dict[str, Any]) -> None:
    def cell(iv: dict[str, Any]) -> str:
        return f"{iv['median']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"

    print(f"{'figure':<12} {'pdserve bench':>26} {'AIPerf':>26}  agree")
    for name, row in result["rows"].items():
        print(f"{name:<12} {cell(row['pdserve_bench']):>26} {cell(row['aiperf']):>26}  "
              f"{'yes' if row['agree'] else 'no'}")
    print("per run: requests completed/failed, send lag p90 (s), AIPerf event-loop stall "
          "max (s)")
    for tool, runs in result["per_run"].items():
        for k, r in enumerate(runs, 1):
            stall = f", stall {r['client_stall_max_s']:.2f}" if "client_stall_max_s" in r else ""
            print(f"  {tool} {k}: {r['completed']}/{r['failed']}, "
                  f"lag {r['send_lag_p90_s']:.2f}{stall}")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aiperf", required=True, help="the aiperf executable")
    parser.add_argument("--trace", required=True, help="a Mooncake JSONL trace")
    parser.add_argument("--conversations", type=int, default=6,
                        help="whole conversations drawn from the trace")
    parser.add_argument("--trace-rate", type=float, default=0.5,
                        help="mean requests/s of the replay")
    parser.add_argument("--seed", type=int, default=0, help="the conversations drawn")
    parser.add_argument("--runs", type=int, default=3, help="runs of each tool")
    parser.add_argument("--confidence-level", type=float, default=0.95)
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--model", default="", help="served model name (default: asked)")
    parser.add_argument("--run-timeout", type=float, default=600.0,
                        help="seconds one run of either tool may take")
    parser.add_argument("--client-priority", type=int, default=0,
                        help="run both tools at this SCHED_FIFO priority (chrt; needs "
                        "CAP_SYS_NICE), so busy engines cannot hold their clients off a core; "
                        "0: the ordinary scheduler")
    parser.add_argument("--workdir", default="bench-results/trace_aiperf")
    parser.add_argument("--json", default="", help="write the comparison here as JSON")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli()
