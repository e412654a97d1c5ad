"""The network-namespace fabric and the pdserve stack on it, one per module: Redis, a
router, a prefill worker and two decode workers (KV over gRPC to one, over
torch.distributed to the other), each on a host of its own (services/bench/netns.py,
shared with the network chaos benchmark)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.bench.netns import Fabric, unavailable
from services.bench.netns_stack import PD_HOSTS, NetStack, start_pd

HOSTS = PD_HOSTS
KV_LEASE_S = 10.0  # the workers' transfer lease: the bound on anything staged or held
CLIENT_LEASE_S = 5.0  # the router's per-client slot TTL in Redis


@pytest.fixture(scope="module")
def fabric() -> Iterator[Fabric]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network-namespace tests: {reason}")
    fabric = Fabric.create(HOSTS)
    try:
        yield fabric
    finally:
        fabric.close()


@pytest.fixture(scope="module")
async def netstack(fabric: Fabric, tmp_path_factory: pytest.TempPathFactory,
                   model_path: Path, offline_reference_proc: object
                   ) -> AsyncIterator[NetStack]:
    # offline_reference_proc: vLLM's offline reference loads while the stack starts.
    stack = NetStack(fabric, tmp_path_factory.mktemp("netns"))
    try:
        await start_pd(stack, KV_LEASE_S, CLIENT_LEASE_S)
        yield stack
    finally:
        fabric.heal()  # a test that failed mid-fault leaves no cut for the next module
        await stack.close_registry()
        stack.close()
