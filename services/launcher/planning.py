"""The live planner in `pdserve up` (`--planner-profile`): each interval, read the decode
workers' metrics, let `services.plan.live.LivePlanner` decide, and write a changed
split to the desired state, which the launcher's loop applies like `pdserve scale`."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from services.launcher.settings import Stack
from services.launcher.watch import Watch
from services.observability.fleet import fetch, metrics_address
from services.plan.costmodel import Profile
from services.plan.live import LivePlanner, PlannerError, PlannerSettings, TrafficMeter
from services.registry.registry import Registry
from services.traffic.slo import parse_slos

log = logging.getLogger(__name__)


def live_planner(stack: Stack) -> LivePlanner | None:
    """The planner `stack` asks for (None: off); PlannerError on a setting that cannot work,
    before anything is started."""
    lc = stack.launcher
    if not lc.planner_profile:
        return None
    try:
        profile = Profile.load(Path(lc.planner_profile))
        slos = parse_slos([lc.planner_slo])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlannerError(f"--planner-profile {lc.planner_profile}: {e}") from None
    if not slos.as_dict():
        raise PlannerError("--planner-slo: name at least one SLO, e.g. ttft=0.5,itl=0.05")
    if not (lc.prefill_accelerator and lc.decode_accelerator):
        raise PlannerError("--planner-profile: the live planner moves GPU workers between the "
                           "pools; start a GPU stack (--prefill-accelerator and "
                           "--decode-accelerator), or on CPU apply `pdserve plan predict`'s "
                           "flags at start")
    settings = PlannerSettings(slos, lc.planner_interval_s, lc.planner_cooldown_s,
                               lc.planner_min_prefill, lc.planner_min_decode,
                               lc.planner_margin)
    return LivePlanner(profile, settings, transport=stack.worker.kv_transport,
                       local_prefill_max_tokens=stack.router.local_prefill_max_tokens)


async def decode_pages(registry: Registry) -> dict[str, tuple[int, str | None]]:
    """worker id -> (restart epoch, its metrics page) for every live decode worker."""
    records = [r for r in await registry.workers() if r.role == "decode"]
    pages = await asyncio.gather(*(asyncio.to_thread(fetch, metrics_address(r, {}))
                                   for r in records))
    return {r.worker_id: (r.epoch, page) for r, page in zip(records, pages, strict=True)}


async def run_planner(planner: LivePlanner, registry: Registry, watch: Watch) -> None:
    """Decide every interval, forever (cancel to stop); a failed round is logged and the
    next one tries again."""
    meter = TrafficMeter()
    while True:
        try:
            await _round(planner, meter, registry, watch)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the live planner's round failed")
        await asyncio.sleep(planner.settings.interval_s)


async def _round(planner: LivePlanner, meter: TrafficMeter, registry: Registry,
                 watch: Watch) -> None:
    traffic = meter.window(await decode_pages(registry), time.monotonic())
    if traffic is None:
        return  # the first look: the window starts here
    current = (watch.desired.prefill, watch.desired.decode)
    # The simulation takes seconds of CPU: off the loop that probes the actors.
    d = await asyncio.to_thread(planner.decide, traffic, current, time.monotonic())
    if d.action != "resize":
        log.info("planner: keeping %dp%dd (%s): %s", *current, d.action, d.reason)
        return
    if (watch.desired.prefill, watch.desired.decode) != current:
        log.info("planner: the sizes changed while it decided (pdserve scale); deciding "
                 "again next round")
        return
    p, d_count = d.chosen
    log.warning("planner: moving from %dp%dd to %dp%dd: %s", *current, p, d_count, d.reason)
    watch.desired = watch.desired.updated(prefill=p, decode=d_count)
    await watch.state.write(watch.desired)
