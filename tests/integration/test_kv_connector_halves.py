"""The connector's worker halves in process, without vLLM: a `Producer` fed layer by
layer as vLLM's forward pass feeds it, a `Consumer` whose real receiver listens on
loopback, and paged caches as plain tensors. What the decode side's cache holds after
the load must be the prefill side's blocks, bit for bit, in the blocks the decode side
chose; blocks are handed back to vLLM only once it finished the request."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from services.kv.consumer import Consumer
from services.kv.fingerprint import LayoutFingerprint, PeerIdentity
from services.kv.metadata import LoadJob, PdserveConnectorMetadata, SaveJob
from services.kv.producer import Producer
from services.kv.transport import TransportConfig

pytestmark = pytest.mark.timeout(120)

FP = LayoutFingerprint("tiny", "float32", 16, 3, 2, 8, "cpu:test", "0.1.0")
PREFILL = PeerIdentity("prefill-t", 1, FP)
DECODE = PeerIdentity("decode-t", 2, FP)
CFG = TransportConfig(chunk_bytes=8 << 10, lease_s=5.0, stall_timeout_s=2.0)
LAYERS = [f"model.layers.{i}.self_attn" for i in range(3)]
BLOCK_SHAPE = (2, 16, 16)  # (kv heads, block size, 2 * head size), per block
NUM_BLOCKS = 12


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    """A paged cache per layer: NUM_BLOCKS blocks (random, or zeros)."""
    g = torch.Generator().manual_seed(seed or 0)
    return {name: (torch.randn((NUM_BLOCKS, *BLOCK_SHAPE), generator=g) if seed is not None
                   else torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE))) for name in LAYERS}


@pytest.fixture
def halves(request: pytest.FixtureRequest) -> Iterator[tuple[Producer, Consumer]]:
    producer = Producer(PREFILL, CFG, lease_s=5.0, allow_faults=False, shm=True)
    consumer = Consumer(DECODE, CFG, "grpc", "127.0.0.1", 0, load_timeout_s=10.0,
                        unknown_grace_s=5.0, allow_faults=False)
    yield producer, consumer
    producer.close()
    consumer.close()


def save_job(consumer: Consumer, tid: str, blocks: list[int], same_host: bool) -> SaveJob:
    return SaveJob(req_id=f"req-{tid}", transfer_id=tid, kv_address=consumer.receiver.address,
                   kv_transport="grpc", decode_epoch=DECODE.epoch,
                   decode_fingerprint=FP.digest(), block_ids=blocks,
                   num_tokens=len(blocks) * 16, same_host=same_host)


def load_until_done(consumer: Consumer, job: LoadJob, timeout_s: float = 20.0
                    ) -> tuple[set[str], set[str]]:
    """Steps of the decode engine: the first carries the load job, later ones poll."""
    consumer.start_load_kv(PdserveConnectorMetadata(loads=[job]))
    deadline = time.monotonic() + timeout_s
    while True:
        done, failed = consumer.get_transfer_results()
        if done:
            return done, failed
        assert time.monotonic() < deadline, "the load never finished"
        time.sleep(0.02)
        consumer.start_load_kv(PdserveConnectorMetadata())


@pytest.mark.parametrize("same_host", [False, True], ids=["grpc", "shm"])
def test_blocks_arrive_bit_exact_where_the_decode_side_wants_them(
        halves: tuple[Producer, Consumer], same_host: bool) -> None:
    producer, consumer = halves
    prefill_cache, decode_cache = caches(seed=1), caches(seed=None)
    producer.register_kv_caches(prefill_cache)
    consumer.register_kv_caches(decode_cache)
    tid = f"t-{'shm' if same_host else 'grpc'}"
    job = save_job(consumer, tid, blocks=[7, 2, 9], same_host=same_host)
    meta = PdserveConnectorMetadata(saves=[job])
    for name in LAYERS:  # the forward pass, one layer after another
        producer.save_kv_layer(meta, name, prefill_cache[name])
    done, failed = load_until_done(consumer, LoadJob(f"dreq-{tid}", tid, [4, 5, 6], 0))
    assert done == {f"dreq-{tid}"} and not failed
    for name in LAYERS:
        assert torch.equal(decode_cache[name][[4, 5, 6]], prefill_cache[name][[7, 2, 9]])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (4, 5, 6)]
        assert not decode_cache[name][untouched].any()
    reports = consumer.worker_meta()
    assert reports is not None and reports.reports[0].ok
    report = reports.reports[0]
    assert report.nbytes == 3 * 3 * prefill_cache[LAYERS[0]][0].nbytes
    # Each layer (6 KiB) fits one 8 KiB gRPC chunk; shm announces whole layers: one
    # verified piece per layer either way, and the receiver timed their checksums.
    assert report.chunks == len(LAYERS) and report.checksum_s > 0
    assert report.first_byte_wall <= report.last_byte_wall
    # The prefill side frees its blocks only after the ack and after vLLM finished it:
    # until vLLM says the request is finished, it is never reported.
    assert job.req_id not in producer.get_finished(set())
    deadline = time.monotonic() + 10
    finished: set[str] = set()
    while job.req_id not in finished:
        assert time.monotonic() < deadline, "the transfer was never acknowledged"
        finished |= producer.get_finished({job.req_id})
        time.sleep(0.02)


def test_a_prefix_already_cached_on_the_decode_side_is_skipped(
        halves: tuple[Producer, Consumer]) -> None:
    """remote_first_block: the decode side already holds the first shipped block."""
    producer, consumer = halves
    prefill_cache, decode_cache = caches(seed=2), caches(seed=None)
    producer.register_kv_caches(prefill_cache)
    consumer.register_kv_caches(decode_cache)
    job = save_job(consumer, "t-prefix", blocks=[0, 1, 3], same_host=False)
    for name in LAYERS:
        producer.save_kv_layer(PdserveConnectorMetadata(saves=[job]), name, prefill_cache[name])
    done, failed = load_until_done(consumer, LoadJob("dreq-prefix", "t-prefix", [10, 11], 1))
    assert done == {"dreq-prefix"} and not failed
    for name in LAYERS:
        assert torch.equal(decode_cache[name][[10, 11]], prefill_cache[name][[1, 3]])


def test_a_cancelled_load_releases_at_once_and_an_unknown_one_fails(
        halves: tuple[Producer, Consumer]) -> None:
    _, consumer = halves
    consumer.register_kv_caches(caches(seed=None))
    consumer.start_load_kv(PdserveConnectorMetadata(loads=[LoadJob("dreq-c", "never", [1], 0)]))
    consumer.start_load_kv(PdserveConnectorMetadata(cancelled_loads=["dreq-c"]))
    done, failed = consumer.get_transfer_results()
    assert done == {"dreq-c"}  # vLLM gets its blocks back in the same step
    fast = Consumer(DECODE, CFG, "grpc", "127.0.0.1", 0, load_timeout_s=10.0,
                    unknown_grace_s=0.2, allow_faults=False)
    try:
        fast.register_kv_caches(caches(seed=None))
        done, failed = load_until_done(fast, LoadJob("dreq-u", "no-such-transfer", [1], 0))
        assert done == failed == {"dreq-u"}  # vLLM recomputes (or fails) by its policy
    finally:
        fast.close()


def test_the_send_copies_reuse_one_slab_and_stay_bit_exact(
        halves: tuple[Producer, Consumer]) -> None:
    # Two transfers one after the other: the second's copies go into the slab the first
    # gave back at its ack (no new memory per request), and each arrives bit-exact.
    producer, consumer = halves
    prefill_cache = caches(seed=3)
    producer.register_kv_caches(prefill_cache)
    slabs = set()
    runs = (("t-pool-1", [1, 2, 3], [4, 5, 6]), ("t-pool-2", [8, 0, 5], [9, 1, 2]))
    for tid, blocks, dst in runs:
        decode_cache = caches(seed=None)
        consumer.register_kv_caches(decode_cache)
        job = save_job(consumer, tid, blocks=blocks, same_host=True)
        for name in LAYERS:
            producer.save_kv_layer(PdserveConnectorMetadata(saves=[job]), name,
                                   prefill_cache[name])
        slab = producer._sending[tid].slab
        assert slab is not None
        slabs.add(slab.data_ptr())
        done, failed = load_until_done(consumer, LoadJob(f"dreq-{tid}", tid, dst, 0))
        assert done == {f"dreq-{tid}"} and not failed
        for name in LAYERS:
            assert torch.equal(decode_cache[name][dst], prefill_cache[name][blocks])
        deadline = time.monotonic() + 10
        while job.req_id not in producer.get_finished({job.req_id}):
            assert time.monotonic() < deadline, "the transfer was never acknowledged"
            time.sleep(0.02)
    assert len(slabs) == 1 and producer._pool.pooled_bytes == slab.numel()
