"""Chaos and soak runs against `pdserve up --prefill 1 --decode 1`, and network chaos on
hosts of their own (network namespaces).

Chaos (default): one seeded mixed schedule (chat-length requests plus long prompts,
Poisson arrivals, greedy, `ignore_eos`, fixed output lengths) runs for a few minutes
while faults are injected at set times: SIGKILL of the decode worker's process, of the
prefill worker's, of redis-server, and SIGSTOP of the decode worker for 10 s. Every
request's tokens, chunk arrival times, status and `Final.migrations` are kept and each
answer is compared token by token with the same prompt run greedy on vLLM's offline
engine (before the stack starts). Reported: requests sent, finished, finished identical,
errors by status, the longest gap between two tokens a client saw and the fault it
followed, the time from each fault to the stack being whole again (see
services/bench/faults.py) and to the first token of the first request sent after it,
migrations (from the finals and the router's pdserve_migrations_total), and the
re-prefill time of the longest context on the idle stack (the bound of the longest gap).

Soak (--soak): first the capacity (requests/s at a fixed concurrency, closed loop, for
--capacity-s) unless --capacity is given; then Poisson load at --load-share of it for
--minutes, no faults, sampling every --sample-s the RSS, descriptors and threads of
every process of the stack (launcher, Ray, router, workers, their vLLM engine processes,
redis-server), Redis's key count, vLLM's KV cache usage and any staged-transfer gauge of
each worker; after the load, until KV usage and staged transfers are back to zero (or
--settle-s). Reported: growth of each between minute 5 (--growth-from-s) and the end.

Network chaos (--net; root): the stack of `make test-netns` (services/bench/netns.py):
Redis, the router, a prefill worker and two decode workers (KV over gRPC to one, over
torch.distributed to the other), each on a host (network namespace) of its own on a
bridge, with mTLS and an API key. The same kind of schedule runs while network faults
take their turn (see services/bench/faults.py): a cut between prefill and the decode host
receiving a transfer, between the router and a decode host mid-stream, between the router
and Redis, a loss burst, a latency burst, and one decode worker partitioned from every
other host. Reported as for chaos, plus: each stream clean (token-identical to the
offline reference, or one status after a prefix of it), per fault the requests sent while
it lasted and how they ended, and after the load how long until nothing is staged, in
flight or leased (staged transfers and bytes on every worker, the router's requests in
flight, the client slots in Redis).

The `pdserve up` stack is started by the script as a child process on loopback ports (its
log in OUT/up.log) and stopped with `pdserve down` and its process group, even on errors;
the network stack's logs are in OUT/netns/, its namespaces removed however the run ends.

    python benchmarks/chaos.py --out bench-results/chaos
    python benchmarks/chaos.py --net --out bench-results/net-chaos
    python benchmarks/chaos.py --soak --minutes 30 --out bench-results/soak
    python benchmarks/chaos.py --quick --out bench-results/chaos-quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.faults import Fault, FaultEvent, FaultPlan  # noqa: E402
from services.bench.targets import GrpcTarget  # noqa: E402
from services.bench.upstack import UpStack  # noqa: E402
from services.traffic.arrivals import ArrivalConfig, send_offsets  # noqa: E402
from services.traffic.request import RequestSpec  # noqa: E402
from services.traffic.workload import LengthDist, WorkloadConfig, build_workload  # noqa: E402

FULL_FAULTS = ["kill-decode@30", "kill-prefill@95", "kill-redis@160", "stop-decode@190:10"]
QUICK_FAULTS = ["kill-decode@15", "kill-redis@70", "stop-decode@85:10"]
NET_FAULTS = ["cut-prefill-decode@15:10", "cut-decode-router@55:15", "cut-router-redis@95:10",
              "loss@125:15:0.1", "latency@160:15:100", "partition-decode@195:20"]
NET_QUICK_FAULTS = ["partition-decode@15:10"]
KV_LEASE_S = 10.0  # the workers' transfer lease: the bound on anything staged or held
CLIENT_LEASE_S = 5.0  # the router's per-client slot TTL in Redis


def workload(args: argparse.Namespace, n: int) -> list[RequestSpec]:
    from services.engine.model import resolve_model
    from services.traffic.workload import load_tokenizer

    cfg = WorkloadConfig(
        dataset="mixed", num_requests=n, seed=args.seed,
        input_len=LengthDist(args.input_len, "uniform", 0.5),
        output_len=LengthDist(args.output_len), long_share=args.long_share,
        long_input_len=LengthDist(args.long_input_len, "uniform", 0.1),
        long_output_len=LengthDist(args.long_output_len))
    return build_workload(cfg, load_tokenizer(str(resolve_model("", "float32"))))


def schedule(args: argparse.Namespace, rate: float, duration: float) -> tuple[
        ArrivalConfig, list[RequestSpec]]:
    """The arrivals and exactly the requests they send (one spec per request)."""
    arrivals = ArrivalConfig(rate=rate, duration_s=duration, seed=args.seed)
    n = len(send_offsets(arrivals, math.ceil(rate * duration * 3) + 20))
    return arrivals, workload(args, n)


async def router_migrations(url: str) -> dict[str, float]:
    """pdserve_migrations_total of the router (its metrics at `url`), by reason."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name == "pdserve_migrations_total":
                reason = s.labels.get("reason", "")
                out[reason] = out.get(reason, 0.0) + float(s.value)
    return out


async def reprefill_s(stack: UpStack, ids: list[int], rounds: int = 3) -> float:
    """Time to first token of a context as long as `ids` on the idle stack, with nothing
    of it in any prefix cache (the ids reversed and rotated, new each round; best of
    `rounds`): what re-prefilling that context costs a stream moved to a fresh worker."""
    from services.bench.tokens import first_token_s

    target = GrpcTarget(stack.address)
    await target.start()
    try:
        times = []
        for k in range(rounds):
            fresh = ids[::-1][k + 1:] + ids[::-1][: k + 1]
            times.append(await first_token_s(target, RequestSpec(fresh, 1), f"reprefill-{k}"))
    finally:
        await target.close()
    return min(times)


def prober(target: GrpcTarget, spec: RequestSpec) -> Callable[[], Awaitable[float]]:
    """A probe for `FaultPlan`: one new request; the epoch time of its first token."""
    from services.bench.tokens import first_token_s

    count = 0

    async def probe() -> float:
        nonlocal count
        count += 1
        start = time.time()
        return start + await first_token_s(target, spec, f"probe-{count}")

    return probe


async def chaos(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from services.bench.chaos_report import summarize_chaos, timeline_plot
    from services.bench.reference import greedy_reference
    from services.bench.tokens import TokenRunner, TokenTarget
    from services.engine.model import resolve_model

    arrivals, specs = schedule(args, args.rate, args.duration)
    faults = [Fault.parse(f) for f in args.faults]
    print(f"{len(specs)} requests over {args.duration:g} s; faults: {', '.join(args.faults)}")
    reference = None
    if not args.no_reference:
        t = time.monotonic()
        reference = await asyncio.to_thread(
            greedy_reference, str(resolve_model("", "float32")), specs, out)
        print(f"reference outputs from vLLM's offline engine in {time.monotonic() - t:.0f} s")
    stack = UpStack(out, args.up_arg)
    stack.start()
    cpu_samples: list[dict[str, float]] = []
    try:
        print(f"pdserve up ready in {await stack.wait_ready(args.ready_timeout):.0f} s")
        runner = TokenRunner(TokenTarget(stack.address), drain_timeout_s=args.drain)
        await runner.start()
        probes = GrpcTarget(stack.address)
        await probes.start()
        short = min(specs, key=lambda s: len(s.prompt_ids))
        plan = FaultPlan(stack, faults, recover_timeout_s=args.recover_timeout,
                         probe=prober(probes, RequestSpec(short.prompt_ids, 4, "probe")),
                         busy=lambda: runner.live is not None
                         and runner.live.running >= args.fault_inflight)
        cpu = asyncio.create_task(cpu_watch(stack, cpu_samples))
        t0 = time.time()
        faulting = asyncio.create_task(plan.run(t0))
        try:
            result = await runner.run(specs, arrivals, label="chaos",
                                      num_requests=len(specs))
        finally:
            await runner.close()
        # Faults late in the schedule are still watched until whole again.
        events: list[FaultEvent] = await faulting
        await probes.close()
        cpu.cancel()
        longest = max(specs, key=lambda s: len(s.prompt_ids) + s.output_len)
        tail = list(reference[specs.index(longest)]) if reference else [1] * longest.output_len
        bound_ids = longest.prompt_ids + tail
        reprefill = await reprefill_s(stack, bound_ids[: 2048 - 1])
        migrations = await router_migrations(
            f"http://127.0.0.1:{stack.metrics_port}/metrics")
    finally:
        await stack.close()
    # The raw material first: an analysis that fails can be redone from it.
    (out / "raw.json").write_text(json.dumps({
        "t0": t0, "records": [r.to_dict() for r in result.records],
        "tokens": {i: asdict(t) for i, t in runner.tokens.items()},
        "events": [e.to_dict() for e in events]}, default=str))
    summary = summarize_chaos(result.records, runner.tokens, reference, events)
    plot = timeline_plot(result.records, runner.tokens, events, t0, args.plot)
    for g in summary["longest_gaps"]:
        # What else the machine was doing while the client waited.
        during = [c for c in cpu_samples if g["start"] < c["t"] <= g["start"] + g["gap_s"] + 1]
        if during:
            g["cores_busy_machine"] = sum(c["machine"] for c in during) / len(during)
            g["cores_busy_others"] = sum(c["machine"] - c["stack"] - c["bench"]
                                         for c in during) / len(during)
    gap = summary["longest_gap"]["gap_s"] if summary["longest_gap"] else 0.0
    summary.update({
        "started_at": t0, "rate": args.rate, "duration_s": args.duration,
        "router_migrations_total": migrations,
        "longest_context_tokens": len(bound_ids), "reprefill_longest_s": reprefill,
        "gap_bound_s": reprefill + 1.0, "gap_within_bound": gap <= reprefill + 1.0,
        "cpu": cpu_samples, "plot": str(plot), "args": vars(args)})
    return summary


async def cpu_watch(stack: Any, out: list[dict[str, float]], every_s: float = 1.0) -> None:
    """Every second: cores busy on the whole machine, in the stack's processes and in
    this one, so that a stall can be told from a machine busy with other work."""
    import psutil

    def busy() -> tuple[float, float, float]:
        total = psutil.cpu_times()
        machine = total.user + total.system + total.nice + getattr(total, "irq", 0.0) + \
            getattr(total, "softirq", 0.0)
        mine = 0.0
        for p in stack.tree():
            try:
                t = p.cpu_times()
                mine += t.user + t.system
            except psutil.Error:
                continue
        own = psutil.Process().cpu_times()
        return machine, mine, own.user + own.system

    # /proc reads off the event loop: one of a process that is mapping or freeing gigabytes
    # (an engine starting or dying) can block for seconds, and every client stream of
    # this process would seem to stall with it.
    prev, at = await asyncio.to_thread(busy), time.time()
    while True:
        await asyncio.sleep(every_s)
        now, t = await asyncio.to_thread(busy), time.time()
        dt = t - at
        # A process that exited takes its CPU time with it: the stack's figure can dip.
        out.append({"t": t, "machine": (now[0] - prev[0]) / dt,
                    "stack": max(0.0, now[1] - prev[1]) / dt, "bench": (now[2] - prev[2]) / dt})
        prev, at = now, t


async def settle(stack: Any, workers: tuple[str, ...], bound_s: float) -> dict[str, Any]:
    """After the load: poll what is staged, in flight or leased until all of it is zero
    or `bound_s` passed. The last reading and how long it took to reach zero."""
    start = time.monotonic()
    state: dict[str, Any] = {}
    while True:
        try:
            state = await asyncio.to_thread(stack.held, list(workers))
        except Exception as e:  # a worker that does not answer is reported, not skipped
            state = {"error": f"{type(e).__name__}: {e}"}
        zero = "error" not in state and all(not v for v in state.values())
        waited = time.monotonic() - start
        if zero or waited > bound_s:
            return {"held": state, "zero": zero, "seconds_to_zero": waited if zero else None,
                    "bound_s": bound_s}
        await asyncio.sleep(0.5)


async def net_chaos(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from services.bench.chaos_report import summarize_chaos, timeline_plot
    from services.bench.netns import Fabric, unavailable
    from services.bench.netns_stack import (
        API_KEY,
        METRICS_PORT,
        PD_HOSTS,
        WORKERS,
        NetFaults,
        NetStack,
        start_pd,
    )
    from services.bench.reference import greedy_reference
    from services.bench.tokens import TokenRunner, TokenTarget
    from services.engine.model import resolve_model
    from services.security import certs
    from services.security.tls import TLSFiles

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"network chaos needs network namespaces: {reason}")
    arrivals, specs = schedule(args, args.rate, args.duration)
    faults = [Fault.parse(f) for f in args.faults]
    print(f"{len(specs)} requests over {args.duration:g} s; faults: {', '.join(args.faults)}")
    reference = None
    if not args.no_reference:
        t = time.monotonic()
        reference = await asyncio.to_thread(
            greedy_reference, str(resolve_model("", "float32")), specs, out)
        print(f"reference outputs from vLLM's offline engine in {time.monotonic() - t:.0f} s")
    workdir = out / "netns"
    # A new run has new addresses: the last run's certificates and logs go.
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    fabric = Fabric.create(PD_HOSTS)
    stack = NetStack(fabric, workdir)
    cpu_samples: list[dict[str, float]] = []
    try:
        t = time.monotonic()
        await start_pd(stack, KV_LEASE_S, CLIENT_LEASE_S, client_max_inflight=64)
        print(f"stack on {len(PD_HOSTS)} hosts ready in {time.monotonic() - t:.0f} s")
        address = stack.target("router")
        tls = TLSFiles(ca=certs.public_files(stack.certs_dir, "server").ca)
        router = (fabric.addr("router"),)  # the targets refuse other hosts than these
        runner = TokenRunner(TokenTarget(address, api_key=API_KEY, tls=tls,
                                         allowed_hosts=router), drain_timeout_s=args.drain)
        await runner.start()
        # A probe waits at most this long for its answer, then tries again.
        probes = GrpcTarget(address, api_key=API_KEY, tls=tls, allowed_hosts=router,
                            timeout_s=args.probe_timeout)
        await probes.start()
        short = min(specs, key=lambda s: len(s.prompt_ids))
        plan = FaultPlan(stack, faults, recover_timeout_s=args.recover_timeout,
                         probe=prober(probes, RequestSpec(short.prompt_ids, 4, "probe")),
                         busy=lambda: runner.live is not None
                         and runner.live.running >= args.fault_inflight,
                         network=NetFaults(fabric, workdir))
        cpu = asyncio.create_task(cpu_watch(stack, cpu_samples))
        t0 = time.time()
        faulting = asyncio.create_task(plan.run(t0))
        try:
            result = await runner.run(specs, arrivals, label="net chaos",
                                      num_requests=len(specs))
        finally:
            await runner.close()
        events: list[FaultEvent] = await faulting
        await probes.close()
        cpu.cancel()
        fabric.heal()  # nothing of a fault outlives the run, whatever ended it
        after = await settle(stack, WORKERS, KV_LEASE_S + CLIENT_LEASE_S + 20.0)
        migrations = await router_migrations(
            f"http://{fabric.addr('router')}:{METRICS_PORT}/metrics")
    finally:
        await stack.close_registry()
        stack.close()
        fabric.close()
    (out / "raw.json").write_text(json.dumps({
        "t0": t0, "records": [r.to_dict() for r in result.records],
        "tokens": {i: asdict(t) for i, t in runner.tokens.items()},
        "events": [e.to_dict() for e in events]}, default=str))
    summary = summarize_chaos(result.records, runner.tokens, reference, events)
    plot = timeline_plot(result.records, runner.tokens, events, t0, args.plot)
    served = [f["served_s"] for f in summary["faults"]]
    summary.update({
        "started_at": t0, "rate": args.rate, "duration_s": args.duration, "network": True,
        "router_migrations_total": migrations, "after_load": after,
        "goals": {
            "streams_clean": summary["clean"] is not None
            and summary["clean"] == summary["sent"],
            "served_within_5_s": all(s is not None and s <= 5.0 for s in served),
            "nothing_held_after": after["zero"]},
        "cpu": cpu_samples, "plot": str(plot), "args": vars(args)})
    return summary


def print_chaos(s: dict[str, Any]) -> None:
    ident = s["finished_identical"]
    print(f"sent {s['sent']}, finished {s['finished']}, identical "
          f"{ident if ident is not None else '-'}, lost {s['lost']}, errors {s['errors']}")
    print(f"migrations: {s['migrations']} in {s['migrated_requests']} requests; router "
          f"counter {s['router_migrations_total']}")
    if s["longest_gap"] and "reprefill_longest_s" in s:
        g = s["longest_gap"]
        print(f"longest gap {g['gap_s']:.2f} s ({g['request_id']}, after {g['fault']}); "
              f"bound: re-prefill of {s['longest_context_tokens']} tokens "
              f"{s['reprefill_longest_s']:.2f} s + 1 s")
    elif s["longest_gap"]:
        g = s["longest_gap"]
        print(f"longest gap {g['gap_s']:.2f} s ({g['request_id']}, after {g['fault']})")
    if s.get("network"):
        print(f"clean streams {s['clean']} of {s['sent']} (not clean: {s['not_clean']}); "
              f"after the load: {s['after_load']}; goals: {s['goals']}")
    for f in s["faults"]:
        rec = f"{f['recovery_s']:.1f} s ({f['recovered_how']})" if f["recovery_s"] else \
            f"not whole again {f['error']}"
        probe = f["served_s"]
        print(f"  {f['label']:<28} {f['target']:<24} whole again after {rec}; a request "
              f"sent at the fault had its first token "
              f"{probe if probe is None else round(probe, 2)} s after it "
              f"({f['probe_failures']} refused before); sent during it: {f['during']}")


async def capacity(args: argparse.Namespace, stack: UpStack) -> float:
    """Requests/s the stack completes at a fixed concurrency (closed loop)."""
    from services.bench.runner import Runner
    from services.traffic.summary import summarize

    arrivals = ArrivalConfig(max_concurrency=args.capacity_concurrency,
                             duration_s=args.capacity_s, seed=args.seed)
    runner = Runner(GrpcTarget(stack.address), drain_timeout_s=120)
    await runner.start()
    try:
        specs = workload(args, 400)
        result = await runner.run(specs, arrivals, label="capacity", num_requests=len(specs))
    finally:
        await runner.close()
    return float(summarize(result.records)["request_throughput"])


async def soak(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from services.bench.chaos_report import soak_growth, soak_plot
    from services.bench.procstats import sample, series
    from services.bench.runner import Runner
    from services.traffic.summary import summarize

    stack = UpStack(out, args.up_arg)
    stack.start()
    samples = []
    try:
        print(f"pdserve up ready in {await stack.wait_ready(args.ready_timeout):.0f} s")
        measured = args.capacity or await capacity(args, stack)
        rate = args.load_share * measured
        print(f"capacity {measured:.3f} req/s; soak at {rate:.3f} req/s for {args.minutes} min")
        await asyncio.sleep(5)
        idle = await sample(stack)
        arrivals, specs = schedule(args, rate, args.minutes * 60)
        runner = Runner(GrpcTarget(stack.address), drain_timeout_s=args.drain)
        await runner.start()
        t0 = time.time()

        async def keep_sampling() -> None:
            while True:
                try:
                    samples.append(await sample(stack))
                except Exception as e:  # one bad sample must not end the sampling
                    print(f"sample failed: {type(e).__name__}: {e}", file=sys.stderr)
                await asyncio.sleep(args.sample_s)

        sampler = asyncio.create_task(keep_sampling())
        try:
            result = await runner.run(specs, arrivals, label="soak", num_requests=len(specs))
        finally:
            sampler.cancel()
            await runner.close()
        load_end = time.time()
        settled = None
        while time.time() < load_end + args.settle_s:
            s = await sample(stack)
            samples.append(s)
            if s.kv_usage and not any(s.kv_usage.values()) and not any(s.staged.values()):
                settled = s.t - load_end
                break
            await asyncio.sleep(1.0)
    finally:
        await stack.close()
    cols = series(samples)
    (out / "raw.json").write_text(json.dumps({
        "t0": t0, "load_end": load_end, "series": cols,
        "records": [r.to_dict() for r in result.records]}, default=str))
    last = samples[-1]
    report = {
        "capacity_req_s": measured, "rate": rate, "minutes": args.minutes,
        "load_started_at": t0, "load_ended_at": load_end,
        "load": {k: v for k, v in summarize(result.records).items()
                 if k in ("requests", "completed", "failed", "errors", "request_throughput",
                          "output_token_throughput")},
        "growth_window_s": [args.growth_from_s, load_end - t0],
        "growth": soak_growth(cols, t0 + args.growth_from_s, load_end),
        "after_load": {"kv_usage": last.kv_usage, "staged": last.staged,
                       "staged_gauges_exported": bool(cols["staged"]),
                       "redis_keys": last.redis_keys, "seconds_to_zero": settled},
        "idle_before_load": {"redis_keys": idle.redis_keys, "groups": idle.groups},
        "series": cols,
        "plot": str(soak_plot(cols, t0, load_end, args.plot)), "args": vars(args)}
    return report


def print_soak(r: dict[str, Any]) -> None:
    print(f"load: {r['load']}")
    print(f"growth from {r['growth_window_s'][0]:.0f} s to {r['growth_window_s'][1]:.0f} s:")
    for g, figs in r["growth"]["groups"].items():
        rss = figs["rss_mb"]
        rel = f"{100 * rss['relative']:+.1f}%" if rss["relative"] is not None else "-"
        print(f"  {g:<16} RSS {rss['from'] or 0:8.1f} -> {rss['to'] or 0:8.1f} MiB ({rel}); "
              f"fds {figs['fds']['change']}; threads {figs['threads']['change']}")
    print(f"  redis keys {r['growth']['redis_keys']}")
    print(f"after the load: {r['after_load']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--soak", action="store_true", help="soak run (no faults) instead of chaos")
    p.add_argument("--net", action="store_true",
                   help="network chaos on hosts of their own (network namespaces; root)")
    p.add_argument("--quick", action="store_true",
                   help="short smoke run: chaos 100 s with three faults, or a 2-minute soak")
    p.add_argument("--out", default="bench-results/chaos",
                   help="folder for the stack's log, the reference and the JSON")
    p.add_argument("--json", default="", help="results JSON (default OUT/result.json)")
    p.add_argument("--plot", default="", help="PNG (default docs/benchmarks/chaos.png or "
                   "soak.png)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")
    p.add_argument("--rate", type=float, default=None,
                   help="chaos: requests/s (Poisson; default 0.4, --net 0.3: its two decode "
                   "workers share one core)")
    p.add_argument("--duration", type=float, default=None,
                   help="chaos: seconds of load (nothing is sent after it; default 240, "
                   "--net 230)")
    p.add_argument("--faults", nargs="+", default=None, metavar="KIND@S[:STOP_S]",
                   help="chaos: faults (kill-decode, kill-prefill, kill-redis, stop-decode, "
                   f"stop-prefill) at seconds after the start; default {' '.join(FULL_FAULTS)}; "
                   "--net: network faults (KIND@S[:LASTS_S[:AMOUNT]]: cut-prefill-decode, "
                   "cut-decode-router, cut-router-redis, partition-decode, partition-prefill, "
                   f"loss, latency); default {' '.join(NET_FAULTS)}")
    p.add_argument("--probe-timeout", type=float, default=30.0,
                   help="--net: seconds a probe request may take before it is sent again")
    p.add_argument("--fault-inflight", type=int, default=2,
                   help="chaos: a fault waits (up to 30 s) until this many requests are in "
                   "flight, so it never lands in a quiet gap of the schedule")
    p.add_argument("--no-reference", action="store_true",
                   help="chaos: skip the offline reference (no token comparison)")
    p.add_argument("--recover-timeout", type=float, default=240.0,
                   help="chaos: longest wait for the stack to be whole after a fault")
    p.add_argument("--input-len", type=int, default=100, help="chat prompt tokens (mean, "
                   "uniform +-50%%)")
    p.add_argument("--output-len", type=int, default=96, help="chat output tokens (fixed)")
    p.add_argument("--long-share", type=float, default=0.15, help="share of long prompts")
    p.add_argument("--long-input-len", type=int, default=1500,
                   help="long prompt tokens (mean, uniform +-10%%)")
    p.add_argument("--long-output-len", type=int, default=16,
                   help="long prompts' output tokens (fixed)")
    p.add_argument("--drain", type=float, default=120.0,
                   help="seconds in-flight requests may take after the last send")
    p.add_argument("--ready-timeout", type=float, default=900.0,
                   help="longest wait for the stack to start")
    p.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `pdserve up` (repeat; e.g. --up-arg=--kv-cache-gib "
                   "--up-arg=2)")
    p.add_argument("--minutes", type=float, default=30.0, help="soak: minutes of load")
    p.add_argument("--capacity", type=float, default=0.0,
                   help="soak: capacity in requests/s (0 = measure it first)")
    p.add_argument("--capacity-s", type=float, default=90.0,
                   help="soak: seconds of the capacity measurement")
    p.add_argument("--capacity-concurrency", type=int, default=6,
                   help="soak: requests in flight during the capacity measurement")
    p.add_argument("--load-share", type=float, default=0.8, help="soak: share of capacity")
    p.add_argument("--sample-s", type=float, default=12.0, help="soak: seconds between "
                   "samples")
    p.add_argument("--growth-from-s", type=float, default=300.0,
                   help="soak: growth is measured from this many seconds into the load")
    p.add_argument("--settle-s", type=float, default=90.0,
                   help="soak: longest wait after the load for KV usage and staged transfers "
                   "to reach zero")
    args = p.parse_args(argv)
    if args.net and args.soak:
        p.error("--net is a chaos run: drop --soak")
    if args.rate is None:
        args.rate = 0.3 if args.net else 0.4
    if args.duration is None:
        args.duration = 230.0 if args.net else 240.0
    if args.quick:
        args.duration, args.minutes = min(args.duration, 100.0), min(args.minutes, 2.0)
        args.capacity_s, args.growth_from_s = min(args.capacity_s, 30.0), 30.0
        args.faults = args.faults or (NET_QUICK_FAULTS if args.net else QUICK_FAULTS)
    args.faults = args.faults or (NET_FAULTS if args.net else FULL_FAULTS)
    name = "soak" if args.soak else "net-chaos" if args.net else "chaos"
    args.plot = args.plot or f"docs/benchmarks/{name}.png"
    return args


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    if args.net:
        # The services run as `python -m ...` in the hosts: this repository is on their
        # path wherever the benchmark is started from.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    run = soak(args, out) if args.soak else net_chaos(args, out) if args.net else \
        chaos(args, out)
    result = asyncio.run(run)
    path = Path(args.json or out / "result.json")
    path.write_text(json.dumps(result, indent=2, default=str))
    (print_soak if args.soak else print_chaos)(result)
    print(f"wrote {path} and {result['plot']}")


if __name__ == "__main__":
    main()
