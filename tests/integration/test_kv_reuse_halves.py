"""Shipping only the blocks the decode side lacks, through the connector's worker halves
in process (no vLLM) over every transport: a `Producer` given a SaveJob that starts at
prompt block k, a `Consumer` whose real receiver listens on loopback. The decode cache
must end up with the prefill side's blocks from k on, bit for bit, its own prefix blocks
untouched, the report saying how much of the prompt's KV was shipped; a transfer that
starts at another block than the request expects is refused, never loaded shifted."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from services.kv.consumer import Consumer
from services.kv.metadata import LoadJob, PdserveConnectorMetadata, SaveJob
from services.kv.params import LoadReport
from services.kv.producer import Producer
from services.kv.transport import ReceiveState
from tests.integration.test_kv_connector_halves import (
    CFG,
    DECODE,
    FP,
    LAYERS,
    PREFILL,
    caches,
    load_until_done,
)

pytestmark = pytest.mark.timeout(120)

ROUTES = {  # name: (the decode worker's transport, same host: shared memory)
    "grpc": ("grpc", False), "torch": ("torch", False), "nixl": ("nixl", False),
    "shm": ("grpc", True),
}


@pytest.fixture(params=list(ROUTES))
def route(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def halves(route: str) -> Iterator[tuple[Producer, Consumer]]:
    kind, _ = ROUTES[route]
    producer = Producer(PREFILL, CFG, lease_s=5.0, allow_faults=False, shm=True)
    consumer = Consumer(DECODE, CFG, kind, "127.0.0.1", 0, load_timeout_s=10.0,
                        unknown_grace_s=5.0, allow_faults=False)
    yield producer, consumer
    producer.close()
    consumer.close()


def ship(producer: Producer, consumer: Consumer, route: str, tid: str, blocks: list[int],
         first_block: int, prefill_cache: dict[str, torch.Tensor]) -> SaveJob:
    """The prefill engine's forward pass: the prompt's blocks from `first_block` on (the
    prefill side's ids `blocks`) go out layer by layer."""
    kind, same_host = ROUTES[route]
    job = SaveJob(req_id=f"req-{tid}", transfer_id=tid, kv_address=consumer.receiver.address,
                  kv_transport=kind, decode_epoch=DECODE.epoch,
                  decode_fingerprint=FP.digest(), block_ids=blocks,
                  num_tokens=(first_block + len(blocks)) * 16 - 5, same_host=same_host,
                  first_block=first_block)
    for name in LAYERS:
        producer.save_kv_layer(PdserveConnectorMetadata(saves=[job]), name, prefill_cache[name])
    return job


def report_of(consumer: Consumer) -> LoadReport:
    reports = consumer.worker_meta()
    assert reports is not None and len(reports.reports) == 1
    return reports.reports[0]


def test_only_the_blocks_after_the_reused_prefix_travel_and_land(
        halves: tuple[Producer, Consumer], route: str) -> None:
    producer, consumer = halves
    prefill_cache, decode_cache = caches(seed=5), caches(seed=None)
    prefix = caches(seed=6)  # what the decode side's own prefix cache holds: blocks 0, 1
    for name in LAYERS:
        decode_cache[name][[3, 8]] = prefix[name][[3, 8]]
    producer.register_kv_caches(prefill_cache)
    consumer.register_kv_caches(decode_cache)
    tid = f"reuse-{route}"
    # prompt blocks 0..3 live in prefill blocks [1, 4, 6, 0]; blocks 2 and 3 are shipped
    ship(producer, consumer, route, tid, [6, 0], 2, prefill_cache)
    job = LoadJob(f"dreq-{tid}", tid, [5, 9], 2, transfer_first_block=2, reused_tokens=32)
    done, failed = load_until_done(consumer, job)
    assert done == {f"dreq-{tid}"} and not failed
    for name in LAYERS:
        assert torch.equal(decode_cache[name][[5, 9]], prefill_cache[name][[6, 0]])
        assert torch.equal(decode_cache[name][[3, 8]], prefix[name][[3, 8]])  # untouched
    report = report_of(consumer)
    block_bytes = len(LAYERS) * prefill_cache[LAYERS[0]][0].nbytes
    assert report.ok and report.nbytes == 2 * block_bytes  # half the prompt's KV
    assert report.prompt_nbytes == 4 * block_bytes and report.reused_tokens == 32


def test_a_decode_side_holding_more_loads_less_of_the_transfer(
        halves: tuple[Producer, Consumer], route: str) -> None:
    # The router believed in one cached block, the engine held two: the transfer starts
    # at block 1, the load at block 2.
    producer, consumer = halves
    prefill_cache, decode_cache = caches(seed=7), caches(seed=None)
    producer.register_kv_caches(prefill_cache)
    consumer.register_kv_caches(decode_cache)
    tid = f"more-{route}"
    ship(producer, consumer, route, tid, [4, 6, 0], 1, prefill_cache)
    job = LoadJob(f"dreq-{tid}", tid, [9, 10], 2, transfer_first_block=1, reused_tokens=32)
    done, failed = load_until_done(consumer, job)
    assert done == {f"dreq-{tid}"} and not failed
    for name in LAYERS:
        assert torch.equal(decode_cache[name][[9, 10]], prefill_cache[name][[6, 0]])
    assert report_of(consumer).ok


def test_a_transfer_that_starts_elsewhere_is_refused(
        halves: tuple[Producer, Consumer], route: str) -> None:
    producer, consumer = halves
    prefill_cache, decode_cache = caches(seed=8), caches(seed=None)
    producer.register_kv_caches(prefill_cache)
    consumer.register_kv_caches(decode_cache)
    tid = f"elsewhere-{route}"
    ship(producer, consumer, route, tid, [4, 6, 0], 1, prefill_cache)
    # the request expects every block (first block 0): loading would shift the prompt
    job = LoadJob(f"dreq-{tid}", tid, [8, 9, 10, 11], 0)
    done, failed = load_until_done(consumer, job)
    assert done == failed == {f"dreq-{tid}"}  # vLLM recomputes (or fails) by its policy
    assert not decode_cache[LAYERS[0]].any()
    report = report_of(consumer)
    assert not report.ok and "starts at prompt block 1" in report.error


def test_a_dropped_transfer_leaves_the_receiver_at_once(
        halves: tuple[Producer, Consumer], route: str) -> None:
    # The decode engine decided not to load it (it lost the prefix the transfer leaves
    # out): the receiver frees it, and the sender's outcome lets the prefill side free
    # its blocks.
    producer, consumer = halves
    prefill_cache = caches(seed=9)
    producer.register_kv_caches(prefill_cache)
    consumer.register_kv_caches(caches(seed=None))
    tid = f"dropped-{route}"
    job = ship(producer, consumer, route, tid, [6, 0], 2, prefill_cache)
    consumer.start_load_kv(PdserveConnectorMetadata(dropped_transfers=[tid]))
    assert consumer.receiver.state(tid) is ReceiveState.UNKNOWN
    # A header accepted while the drop lands holds its reservation until its stream sees
    # the refusal; that must end within moments, not at the lease.
    deadline = time.monotonic() + 2
    while consumer.receiver.staged() != (0, 0):
        assert time.monotonic() < deadline, f"still staged: {consumer.receiver.staged()}"
        time.sleep(0.01)
    deadline = time.monotonic() + 10
    while job.req_id not in producer.get_finished({job.req_id}):
        assert time.monotonic() < deadline, "the prefill side never freed its blocks"
        time.sleep(0.02)
