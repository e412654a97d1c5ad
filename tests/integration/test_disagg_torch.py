"""The same disaggregated pair with KV over torch.distributed (gloo on CPU), as started by
default: its engines' schedulers pinned to the engines' cores (`--pin-scheduler`)."""

from __future__ import annotations

import os

import pytest

from services.api.client import PdserveClient
from tests.helpers.servers import DisaggStack, ServerProcess
from tests.integration.test_disagg import check_identical

pytestmark = pytest.mark.engine


async def test_greedy_output_identical_to_colocated(
    disagg_torch: DisaggStack, colocated: ServerProcess, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    await check_identical(disagg_torch, colocated, tokenizer)


async def test_transfer_went_over_torch(disagg_torch: DisaggStack) -> None:
    async with PdserveClient(disagg_torch.server.target) as client:
        result = await client.generate(token_ids=list(range(100, 400)), temperature=0.0,
                                       max_tokens=4, ignore_eos=True)
    assert result.timings["kv_transfer_bytes"] > 0


async def test_each_engine_runs_on_its_own_cores(disagg_torch: DisaggStack) -> None:
    # With --pin-scheduler every thread of an engine (its scheduler process included,
    # which vLLM leaves unpinned) stays on the engine's cores, and the prefill and
    # decode engines of one host share none.
    import psutil

    assert disagg_torch.server.proc is not None
    cores: dict[int, set[int]] = {}
    for p in psutil.Process(disagg_torch.server.proc.pid).children(recursive=True):
        if not p.name().startswith("VLLM::"):
            continue
        worker = next(a for a in p.parents() if not a.name().startswith("VLLM::"))
        mine = cores.setdefault(worker.pid, set())
        for t in p.threads():
            mine |= os.sched_getaffinity(t.id)
    assert len(cores) == 2, cores  # one engine per worker: prefill and decode
    prefill, decode = cores.values()
    assert prefill and decode and not prefill & decode, cores
