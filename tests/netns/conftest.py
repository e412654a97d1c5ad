"""The network-namespace fabric and the pdserve stack on it, one per module: Redis, a
router, a prefill worker and two decode workers (KV over gRPC to one, over
torch.distributed to the other), each on a host of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.netns.harness import Fabric, unavailable
from tests.netns.stack import NetStack

HOSTS = ["redis", "router", "prefill", "decode-grpc", "decode-torch"]
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
    lease = ["--kv-lease-s", str(KV_LEASE_S)]
    try:
        stack.start_redis()
        stack.start_worker("prefill", "prefill", "0", *lease)
        stack.start_worker("decode-grpc", "decode", "1", "--kv-transport", "grpc", *lease)
        stack.start_worker("decode-torch", "decode", "1", "--kv-transport", "torch", *lease)
        # round_robin: consecutive requests alternate between the two decode workers, so
        # both transports carry KV within a few requests.
        stack.start_router("--policy", "round_robin", "--client-max-inflight", "8",
                           "--client-lease-s", str(CLIENT_LEASE_S))
        await stack.wait_ready(["prefill", "decode-grpc", "decode-torch", "router"])
        yield stack
    finally:
        stack.close()
