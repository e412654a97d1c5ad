"""Replaying production traffic through pdserve under each routing mode, and through plain
colocated vLLM on the same cores: what the router's prefix index saves in prefill compute
and KV transfer, what that does to TTFT and goodput, and what the planner predicted, on
the same machine in one run.

Each configuration is a server of its own, started alone, and replayed the same trace
window with `pdserve bench run --trace` (the same seeds, so the same prompts, arrivals
and turn order):
  * colocated: `pdserve serve --mode colocated`, one vLLM engine on every core with the
    KV cache of all the disaggregated engines together (plain vLLM, as the headline
    benchmark runs it);
  * round_robin: `pdserve up`, pairs in turn, no prefix index (the baseline of the
    ratios);
  * approximate: the load policy on the Redis prefix index (which prefill worker was
    sent a prompt's blocks; decode caches invisible), KV events off;
  * precise: the load policy on the engines' own KV events (both pools' caches), and
    the decode worker's cached prefix left out of the transfer;
  * conditional: precise, and prompts up to `--local-prefill-max-tokens` tokens left to
    the decode worker (conditional disaggregation).
With `--runs N` each server replays the window N times in a row, each time with fresh
prompt tokens (seeds seed .. seed + N - 1; the same conversations, arrivals and lengths),
and every figure is the median of the N runs with a confidence interval; the ratios to
round robin pair run k with round robin's run k (the same prompts).

Reported per configuration, from the servers' own counters: prompt tokens the engines
computed (vLLM's `prompt_tokens_by_source{source="local_compute"}`, every engine: neither
the tokens found in a prefix cache nor those whose KV was shipped in), KV bytes shipped
and what shipping every block would have moved; from the replay: TTFT p50/p99, TPOT p50
and goodput under the stated SLOs. With `--profile` (`pdserve plan profile`), the
planner's prediction of each configuration on the same requests, and its error.

    python benchmarks/trace_routing.py --trace ../shared/traces/mooncake_conversation.jsonl \\
        --conversations 6 --trace-rate 0.5 --runs 3 --profile bench-results/plan/profile.json \\
        --json bench-results/trace_routing.json --plot docs/benchmarks/trace_routing.png
    python benchmarks/trace_routing.py --trace ../shared/traces/azure_llm_2023_conv.csv \\
        --trace-start 1200 --requests 12 --trace-rate 0.4 --profile bench-results/plan/profile.json

Configurations can be run one at a time (`--configs precise`) and the table assembled
afterwards from the saved results (`--reuse`), which starts nothing for a configuration
whose result of the same replay is already in `--workdir`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.replays import (  # noqa: E402
    BASELINE,
    COLOCATED,
    COMPUTED,
    DECODE,
    LOCAL_PREFILL_MAX_TOKENS,
    deltas,
    fleet_configs,
    planner_check,
    planner_requests,
    run_figures,
    summarize_config,
)
from services.traffic.intervals import METHODS  # noqa: E402

CONFIGS: dict[str, list[str]] = {
    COLOCATED: ["--mode", "colocated"],
    "round_robin": ["--policy", "round_robin", "--no-kv-events"],
    "approximate": ["--no-kv-events"],
    "precise": [],
    "conditional": ["--local-prefill-max-tokens", str(LOCAL_PREFILL_MAX_TOKENS)],
}


def scrape(address: str) -> dict[str, float]:
    """Counter totals of one server's /metrics, summed over their label sets except
    `source` (vLLM's prompt tokens by where they came from: computed, cached, shipped)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name + (f"{{source={s.labels['source']}}}" if "source" in s.labels
                             else "")
            totals[name] = totals.get(name, 0.0) + s.value
    return totals


def pick(metrics: dict[str, float], role: str) -> dict[str, Any]:
    names = (COMPUTED, *(DECODE if role == "decode" else ()))
    return {"role": role, **{n: metrics.get(n, 0.0) for n in names}}


def replay_args(args: argparse.Namespace) -> list[str]:
    """The `pdserve bench run` flags of the window (the same for every configuration)."""
    out = ["--trace", args.trace, "--trace-start", str(args.trace_start),
           "--trace-rate", str(args.trace_rate), "--max-model-len", str(args.max_model_len),
           "--length-scale", str(args.length_scale)]
    if args.conversations:
        out += ["--trace-conversations", str(args.conversations),
                "--trace-sample-seed", str(args.seed)]
        if args.min_turns > 1:
            out += ["--trace-min-turns", str(args.min_turns)]
    if args.requests:
        out += ["--num-requests", str(args.requests)]
    return out


def replay(args: argparse.Namespace, address: str, out: Path, label: str, seed: int
           ) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "services.cli", "bench", "run", "--address", address,
           *replay_args(args), "--seed", str(seed), "--label", label,
           "--output-dir", str(out), "--no-plots", "--no-progress",
           *(f"--slo={s}" for s in args.slo)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return dict(json.loads((out / "summary.json").read_text()))


class Server:
    """A configuration's server: `pdserve up` (disaggregated) or `pdserve serve --mode
    colocated`, with one way to read every engine's counters."""

    def __init__(self, args: argparse.Namespace, name: str, workdir: Path) -> None:
        self.name, self.workdir, self.args = name, workdir, args
        self.stack: Any = None
        self.colocated: Any = None

    async def start(self) -> None:
        a = self.args
        self.workdir.mkdir(parents=True, exist_ok=True)
        common = ["--max-model-len", str(a.max_model_len), *a.up_arg]
        if self.name == COLOCATED:
            from tests.helpers.servers import ServerProcess

            gib = a.kv_cache_gib * (a.prefill + a.decode)  # the same KV memory in all
            self.colocated = ServerProcess([*CONFIGS[self.name], "--kv-cache-gib", str(gib),
                                            *common], self.workdir / "serve.log")
            self.colocated.start()
            await self.colocated.wait_ready(timeout=900)
            return
        from services.bench.upstack import UpStack

        self.stack = UpStack(self.workdir, [*CONFIGS[self.name], "--kv-cache-gib",
                                            str(a.kv_cache_gib), *common],
                             prefill=a.prefill, decode=a.decode)
        self.stack.start()
        await self.stack.wait_ready(timeout=900, workers=a.prefill + a.decode)

    @property
    def address(self) -> str:
        return str(self.colocated.target if self.colocated else self.stack.address)

    async def counters(self) -> dict[str, dict[str, Any]]:
        """Per engine: its role's counters."""
        if self.colocated is not None:
            port = self.colocated.metrics_port
            return {COLOCATED: pick(scrape(f"127.0.0.1:{port}"), COLOCATED)}
        return {w.worker_id: pick(scrape(w.metrics_address), w.role)
                for w in await self.stack.records()}

    async def close(self) -> None:
        if self.colocated is not None:
            self.colocated.stop()
        if self.stack is not None:
            await self.stack.close()


def result_key(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """What makes a saved configuration result the same replay (for --reuse)."""
    return {"config": name, "flags": CONFIGS[name], "replay": replay_args(args),
            "runs": args.runs, "seed": args.seed, "prefill": args.prefill,
            "decode": args.decode, "kv_cache_gib": args.kv_cache_gib, "slo": args.slo,
            "up_arg": args.up_arg}


def comparable(key: dict[str, Any]) -> dict[str, Any]:
    """A result key as --reuse compares it: the trace by its file name, so a run saved with
    an absolute path is the same replay as one named relative to the checkout."""
    replay = list(key.get("replay", []))
    for i, flag in enumerate(replay[:-1]):
        if flag == "--trace":
            replay[i + 1] = Path(replay[i + 1]).name
    return {**key, "replay": replay}


def saved_result(args: argparse.Namespace, name: str, saved: Path) -> dict[str, Any] | None:
    """The saved result of this very replay for --reuse, or None, saying why it will run."""
    if not saved.exists():
        print(f"--reuse: no saved result for {name} in {saved.parent}; running it",
              file=sys.stderr)
        return None
    old = json.loads(saved.read_text())
    mine, theirs = comparable(result_key(args, name)), comparable(old.get("key") or {})
    if mine == theirs:
        return dict(old)
    differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    print(f"--reuse: the saved result for {name} is another replay (differs in: "
          f"{', '.join(differ)}); running it", file=sys.stderr)
    return None


async def one_config(args: argparse.Namespace, name: str, workdir: Path) -> dict[str, Any]:
    saved = workdir / name / "result.json"
    key = result_key(args, name)
    if args.reuse and (old := saved_result(args, name, saved)) is not None:
        return old
    server = Server(args, name, workdir / name)
    runs: list[dict[str, Any]] = []
    try:
        await server.start()
        for k in range(args.runs):
            before = await server.counters()
            started = time.monotonic()
            summary = await asyncio.to_thread(replay, args, server.address,
                                              workdir / name / f"bench-{k + 1}", name,
                                              args.seed + k)
            elapsed = time.monotonic() - started
            await asyncio.sleep(2.0)  # the last counters reach /metrics
            totals = deltas(before, await server.counters())
            runs.append({"seed": args.seed + k, "replay_s": elapsed, "totals": totals,
                         "summary": summary["runs"][0],
                         "trace": summary.get("meta", {}).get("trace")})
    finally:
        await server.close()
    result = {"key": key, "runs": runs, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    saved.write_text(json.dumps(result, indent=2, default=str))
    return result


def window_replay(args: argparse.Namespace) -> Any:
    """The replayed window as `pdserve bench run` plans it (its lengths, send times and
    prefix reuse do not depend on the prompt tokens)."""
    from services.traffic.traces import ReplayConfig, plan_replay

    cfg = ReplayConfig(path=args.trace, start_s=args.trace_start,
                       max_requests=args.requests or None, rate=args.trace_rate,
                       length_scale=(None if str(args.length_scale) == "auto"
                                     else float(args.length_scale)),
                       max_model_len=args.max_model_len, conversations=args.conversations or None,
                       seed=args.seed, sample_seed=args.seed, min_turns=args.min_turns)
    return plan_replay(cfg, np.arange(1000))


def reuse_bound(replay: Any) -> dict[str, Any]:
    """What the window's own reuse allows: the prompt tokens a prefix cache that held
    every whole block sent before would still compute (vLLM computes at least one token
    of a prompt found whole), against all the window's prompt tokens."""
    prompts = [len(s.prompt_ids) for s in replay.specs]
    computed = sum(max(1, p - r) for p, r in zip(prompts, replay.reused_tokens, strict=True))
    return {"prompt_tokens": sum(prompts), "reused_tokens": sum(replay.reused_tokens),
            "one_cache_computed": computed,
            "requests": len(prompts), "clipped": replay.description["lengths"]["clipped_requests"],
            "length_factor": replay.lengths.factor,
            "next_turn_requests": replay.description["turns"]["next_turn_requests"]}


def predictions(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The planner's figures for each configuration on the replay's own requests: their
    send times, prompts (so that each engine's prefix cache finds what it holds) and turn
    order, on the configuration's router, cores and engines."""
    from services.engine.config import CPU_STEP_BOUNDS
    from services.plan.costmodel import Profile
    from services.plan.predict import simulate
    from services.traffic.slo import parse_slos

    profile = Profile.load(Path(args.profile))
    rep = window_replay(args)
    at = [s.at_s or 0.0 for s in rep.specs]
    outputs = [s.output_len for s in rep.specs]
    reqs = planner_requests(at, [s.prompt_ids for s in rep.specs], outputs,
                            [s.after for s in rep.specs])
    slos = parse_slos(args.slo)
    cores = args.cores or profile.units_total
    out: dict[str, Any] = {}
    steps = (CPU_STEP_BOUNDS["max_num_batched_tokens"],
             CPU_STEP_BOUNDS["long_prefill_token_threshold"])
    engine_kv = int(args.kv_cache_gib * 2**30 // profile.kv_bytes_per_token)
    fleets = fleet_configs(names, args.prefill, args.decode, cores, steps, engine_kv)
    for name, fleet in fleets.items():
        pred = simulate(fleet, profile, reqs, [False] * len(reqs), rep.mean_rate, None, slos)
        s = pred.summary
        out[name] = {"routing": fleet.routing or "one engine",
                     "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
                     "tpot_p50_s": s["tpot_s"]["p50"], "goodput": s["goodput"],
                     "goodput_share": s["goodput_share"],
                     "prompt_tokens_computed": pred.computed_tokens,
                     "kv_bytes_shipped": pred.shipped_bytes if fleet.prefill else None}
    return {"profile": args.profile, "cores": cores, "predicted": out,
            "reused_tokens": sum(rep.reused_tokens),
            "prompt_tokens": sum(len(s.prompt_ids) for s in rep.specs)}


def _fmt(iv: dict[str, Any] | None, scale: float = 1.0, digits: int = 2) -> str:
    if not iv:
        return "-"
    m, lo, hi = iv["median"] * scale, iv["low"] * scale, iv["high"] * scale
    if iv["n"] < 2 or math.isclose(lo, hi):
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def print_table(result: dict[str, Any]) -> None:
    rows = result["rows"]
    print(f"{'config':<12} {'computed':>9} {'vs rr':>18} {'KV MB':>7} {'vs rr':>18} "
          f"{'TTFT p50':>18} {'TTFT p99':>18} {'goodput%':>18}")
    for name, r in rows.items():
        kv = r["kv_bytes_shipped"]
        print(f"{name:<12} {_fmt(r['prompt_tokens_computed'], digits=0):>9} "
              f"{_fmt(r.get('prompt_tokens_computed_vs_round_robin')):>18} "
              f"{_fmt(kv, 1e-6, 0):>7} {_fmt(r.get('kv_bytes_shipped_vs_round_robin')):>18} "
              f"{_fmt(r['ttft_p50_s']):>18} {_fmt(r['ttft_p99_s']):>18} "
              f"{_fmt(r['goodput_share'], 100, 0):>18}")
    if plan := result.get("planner"):
        check = plan["check"]
        print("planner (predicted / measured median):")
        for name, row in check["rows"].items():
            cells = [f"{fig} {_g(c['predicted'])} / {_g(c['measured'])}"
                     for fig, c in row.items()]
            print(f"  {name:<12} " + "; ".join(cells))
        err = check["median_abs_error"]
        print(f"  median |error| {'-' if err is None else f'{100 * err:.0f}%'} over "
              f"{check['errors_counted']} figures")


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = list(rows)
    predicted = (result.get("planner") or {}).get("predicted", {})

    def bars(ax: Any, key: str, offset: float = 0.0, width: float = 0.6,
             scale: float = 1.0, **kw: Any) -> None:
        med, err = [], [[], []]
        for n in names:
            iv = rows[n].get(key)
            m = iv["median"] * scale if iv else 0.0
            med.append(m)
            err[0].append(max(0.0, m - iv["low"] * scale) if iv else 0.0)
            err[1].append(max(0.0, iv["high"] * scale - m) if iv else 0.0)
        ax.bar([i + offset for i in range(len(names))], med, width, yerr=err, capsize=3, **kw)

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    panels = [("prompt tokens computed / round robin", "prompt_tokens_computed_vs_round_robin"),
              ("KV bytes shipped / round robin", "kv_bytes_shipped_vs_round_robin")]
    base = (rows.get(BASELINE) or {}).get("prompt_tokens_computed")
    window = result.get("window") or {}
    for ax, (title, key) in zip(axes[:2], panels, strict=True):
        bars(ax, key, color="tab:blue")
        ax.axhline(0.5, color="tab:red", linestyle="--", linewidth=0.8, label="goal 0.5")
        if key.startswith("prompt") and base and window.get("reused_tokens"):
            ax.axhline(window["one_cache_computed"] / base["median"], color="gray",
                       linestyle=":", linewidth=1.0, label="every reused block found")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    ax = axes[2]
    bars(ax, "ttft_p50_s", -0.2, 0.4, label="p50")
    bars(ax, "ttft_p99_s", 0.2, 0.4, label="p99")
    for i, n in enumerate(names):
        if n in predicted:
            ax.plot([i - 0.2, i + 0.2], [predicted[n]["ttft_p50_s"], predicted[n]["ttft_p99_s"]],
                    "kx", markersize=6, label="planner" if i == 0 else None)
    ax.set_title("TTFT (s), median of runs", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[3]
    bars(ax, "goodput_share", scale=100.0, color="tab:green")
    for i, n in enumerate(names):
        if n in predicted and predicted[n]["goodput_share"] is not None:
            ax.plot([i], [100 * predicted[n]["goodput_share"]], "kx", markersize=6,
                    label="planner" if i == 0 else None)
    ax.set_title("requests within the SLOs (%)", fontsize=9)
    if predicted:
        ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(list(range(len(names))), names, rotation=20, fontsize=8)
    runs = (f"{result['runs']} runs per configuration (bars: median, whiskers: "
            f"{result['confidence_level']:.0%} interval)" if result["runs"] > 1
            else "one run per configuration")
    fig.suptitle(f"{Path(result['trace']).name}: {result['requests']} requests, {runs}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    workdir = Path(args.workdir or f"bench-results/trace_routing/{Path(args.trace).stem}")
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in tqdm(args.configs, desc="configurations"):
        results[name] = await one_config(args, name, workdir)
    figures = {name: [run_figures(r["totals"], r["summary"]) for r in res["runs"]]
               for name, res in results.items()}
    base = figures.get(BASELINE)
    rows = {name: summarize_config(runs, base, args.confidence_level, args.interval_method)
            for name, runs in figures.items()}
    if COLOCATED in rows:  # one engine ships nothing: no KV figures, not a ratio of 0
        for key in [k for k in rows[COLOCATED] if k.startswith("kv_bytes")]:
            rows[COLOCATED][key] = None
    first = next(iter(results.values()))["runs"][0]
    out: dict[str, Any] = {
        "trace": args.trace, "replay": first.get("trace"), "runs": args.runs,
        "confidence_level": args.confidence_level, "interval_method": args.interval_method,
        "slos": args.slo, "prefill": args.prefill, "decode": args.decode,
        "kv_cache_gib": args.kv_cache_gib, "requests": first["summary"].get("requests"),
        "rows": rows, "results": results,
    }
    out["window"] = reuse_bound(window_replay(args))
    if args.profile:
        plan = predictions(args, list(results))
        plan["check"] = planner_check(plan["predicted"], rows)
        out["planner"] = plan
    return out


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="a Mooncake JSONL trace (its hash "
                        "ids make its shared prefixes real) or an Azure CSV trace")
    parser.add_argument("--conversations", type=int, default=0,
                        help="Mooncake: whole conversations drawn from the trace (0: the "
                        "window's consecutive requests)")
    parser.add_argument("--min-turns", type=int, default=1,
                        help="Mooncake: draw only conversations of at least this many "
                        "requests (the trace's multi-turn share of reuse)")
    parser.add_argument("--requests", type=int, default=0,
                        help="at most this many requests of the window (0: all)")
    parser.add_argument("--trace-start", type=float, default=0.0,
                        help="window start, seconds after the trace's first request")
    parser.add_argument("--trace-rate", type=float, default=0.3,
                        help="mean requests/s of the replay (the trace's gaps in proportion)")
    parser.add_argument("--length-scale", default="auto",
                        help="factor on the trace's lengths (auto: as `pdserve bench run`)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the conversations drawn, and the first run's prompt tokens")
    parser.add_argument("--runs", type=int, default=1,
                        help="replays of the window per configuration, fresh prompt tokens "
                        "each; figures are medians of the runs with confidence intervals")
    parser.add_argument("--confidence-level", type=float, default=0.95)
    parser.add_argument("--interval-method", choices=METHODS, default="t",
                        help="as `pdserve bench run --interval-method`")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="configurations to run, in this order")
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="the engines' context; the replay fits the trace to it")
    parser.add_argument("--kv-cache-gib", type=int, default=1,
                        help="KV cache per disaggregated engine (small: evictions happen); "
                        "the colocated engine gets all of theirs together")
    parser.add_argument("--slo", action="append", default=None, metavar="NAME=SECONDS",
                        help="goodput SLOs (default: ttft=10, tpot=0.5: this CPU machine's, "
                        "not the trace's service's)")
    parser.add_argument("--up-arg", action="append", default=[],
                        help="one more server argument for every configuration (repeatable)")
    parser.add_argument("--profile", default="",
                        help="a `pdserve plan profile` JSON: predict every configuration "
                        "on the replay's requests and report the error")
    parser.add_argument("--cores", type=int, default=0,
                        help="cores of this machine for the planner (0: the profile's)")
    parser.add_argument("--reuse", action="store_true",
                        help="take a configuration's saved result of the same replay from "
                        "--workdir instead of running it again")
    parser.add_argument("--workdir", default="",
                        help="server logs and each replay's full results (default: "
                        "bench-results/trace_routing/<trace name>)")
    parser.add_argument("--json", default="", help="write the summary here as JSON")
    parser.add_argument("--plot", default="", help="write the ratios and TTFT here (PNG)")
    args = parser.parse_args()
    args.slo = args.slo or ["ttft=10", "tpot=0.5"]
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    result = asyncio.run(main(args))
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    cli()
