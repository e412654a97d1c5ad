"""KV between tensor-parallel layouts through the connector's worker halves in process
(no vLLM), over every transport: `a` prefill ranks (one `Producer` each, holding its
heads of one model-wide cache) feed `b` decode ranks (one `Consumer` each, with its own
receiver on loopback), as a prefill worker at TP=a feeds a decode worker at TP=b. Each
decode rank's cache must end up holding exactly its heads of the prefill side's blocks,
bit for bit, in the blocks it chose, and nothing else; every prefill rank, those with
nothing to send included, hands its blocks back once vLLM finished the request.

The model has 4 KV heads, so the pairs cover split heads on both sides (2->1, 1->2,
4->2, 2->4) and replicated ones (8 prefill ranks: two hold each head; 8 decode ranks:
two need each head)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from services.kv.consumer import Consumer
from services.kv.fingerprint import LayoutFingerprint, PeerIdentity
from services.kv.metadata import LoadJob, PdserveConnectorMetadata, SaveJob
from services.kv.params import FAULT_CORRUPT_CHUNK, LoadReport
from services.kv.producer import Producer
from services.kv.tp_layout import kv_pieces, rank_heads, sends_of
from services.kv.transport import ReceiveState, TransportConfig
from tests.integration.test_kv_connector_halves import LAYERS, load_until_done

pytestmark = pytest.mark.timeout(180)

HEADS = 4
FP = LayoutFingerprint("tiny", "float32", 16, len(LAYERS), HEADS, 8, "cpu:test", "0.1.0")
PREFILL = PeerIdentity("prefill-tp", 1, FP)
DECODE = PeerIdentity("decode-tp", 2, FP)
# A small staging pool: NIXL registers one arena of it per receiver and per sender.
CFG = TransportConfig(chunk_bytes=8 << 10, lease_s=5.0, stall_timeout_s=2.0,
                      pool_bytes=4 << 20)
PAGE = (16, 16)  # (block size, 2 * head size) of one (block, head) page
NUM_BLOCKS = 12
ROUTES = {  # name: (the decode worker's transport, same host: shared memory)
    "grpc": ("grpc", False), "torch": ("torch", False), "nixl": ("nixl", False),
    "shm": ("grpc", True),
}
PAIRS = [(2, 1), (1, 2), (4, 2), (2, 4), (8, 2), (2, 8)]


@dataclass
class Pair:
    route: str
    producers: list[Producer]
    consumers: list[Consumer]

    @property
    def addresses(self) -> list[str]:
        return [c.receiver.address for c in self.consumers]


@pytest.fixture(params=list(ROUTES))
def route(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def start_pair(route: str, a: int, b: int, allow_faults: bool = False) -> Pair:
    kind, _ = ROUTES[route]
    producers = [Producer(PREFILL, CFG, lease_s=5.0, allow_faults=allow_faults, shm=True,
                          rank=i, tp=a) for i in range(a)]
    consumers = [Consumer(DECODE, CFG, kind, "127.0.0.1", 0, load_timeout_s=10.0,
                          unknown_grace_s=5.0, allow_faults=False, rank=j, tp=b)
                 for j in range(b)]
    return Pair(route, producers, consumers)


def stop_pair(pair: Pair) -> None:
    for half in (*pair.producers, *pair.consumers):
        half.close()


@pytest.fixture
def pairs() -> Iterator[list[Pair]]:
    made: list[Pair] = []
    yield made
    for pair in made:
        stop_pair(pair)


def heads_of(rank: int, tp: int) -> slice:
    held = rank_heads(rank, tp, HEADS)
    return slice(held.start, held.stop)


def model_cache(seed: int) -> dict[str, torch.Tensor]:
    """Every head of every block, as one TP=1 engine would hold them."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn((NUM_BLOCKS, HEADS, *PAGE), generator=g) for name in LAYERS}


def rank_cache(full: dict[str, torch.Tensor] | None, rank: int, tp: int
               ) -> dict[str, torch.Tensor]:
    """Rank `rank`'s paged cache at TP=`tp`: its heads of `full` (None: zeros)."""
    held = heads_of(rank, tp)
    count = held.stop - held.start
    if full is None:
        return {name: torch.zeros((NUM_BLOCKS, count, *PAGE)) for name in LAYERS}
    return {name: full[name][:, held].contiguous() for name in LAYERS}


def ship(pair: Pair, tid: str, blocks: list[int], prefill: list[dict[str, torch.Tensor]],
         fault: str = "") -> SaveJob:
    """The prefill engine's forward pass: every rank gets each layer in turn."""
    kind, same_host = ROUTES[pair.route]
    addresses = pair.addresses
    job = SaveJob(req_id=f"req-{tid}", transfer_id=tid, kv_address=addresses[0],
                  kv_transport=kind, decode_epoch=DECODE.epoch,
                  decode_fingerprint=FP.digest(), block_ids=blocks,
                  num_tokens=len(blocks) * 16, same_host=same_host, fault=fault,
                  kv_addresses=addresses)
    meta = PdserveConnectorMetadata(saves=[job])
    for name in LAYERS:
        for producer, cache in zip(pair.producers, prefill, strict=True):
            producer.save_kv_layer(meta, name, cache[name])
    return job


def wait_finished(producers: list[Producer], req_id: str) -> None:
    """Each prefill rank reports the request once vLLM finished it and its pieces are
    over: vLLM frees the blocks when every rank did."""
    pending = set(range(len(producers)))
    deadline = time.monotonic() + 10
    while pending:
        assert time.monotonic() < deadline, f"ranks {sorted(pending)} never finished sending"
        for i in list(pending):
            if req_id in producers[i].get_finished({req_id}):
                pending.discard(i)
        time.sleep(0.02)


def one_report(consumer: Consumer) -> LoadReport:
    reports = consumer.worker_meta()
    assert reports is not None and len(reports.reports) == 1
    return reports.reports[0]


@pytest.mark.parametrize(("a", "b"), PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
def test_each_decode_rank_gets_exactly_its_heads_bit_exact(
        pairs: list[Pair], route: str, a: int, b: int) -> None:
    pair = start_pair(route, a, b)
    pairs.append(pair)
    full = model_cache(seed=a * 10 + b)
    prefill = [rank_cache(full, i, a) for i in range(a)]
    decode = [rank_cache(None, j, b) for j in range(b)]
    for producer, cache in zip(pair.producers, prefill, strict=True):
        producer.register_kv_caches(cache)
    for consumer, cache in zip(pair.consumers, decode, strict=True):
        consumer.register_kv_caches(cache)
    tid = f"tp-{route}-{a}-{b}"
    src, dst = [7, 2, 9], [4, 5, 6]
    job = ship(pair, tid, src, prefill)
    for j, consumer in enumerate(pair.consumers):
        done, failed = load_until_done(consumer, LoadJob(f"dreq-{tid}", tid, dst, 0,
                                                          prefill_tp=a))
        assert done == {f"dreq-{tid}"} and not failed, one_report(consumer).error
        report = one_report(consumer)
        held = heads_of(j, b)
        assert report.ok and report.nbytes == (
            len(LAYERS) * len(src) * (held.stop - held.start) * full[LAYERS[0]][0, 0].nbytes)
        untouched = [k for k in range(NUM_BLOCKS) if k not in dst]
        for name in LAYERS:
            assert torch.equal(decode[j][name][dst], full[name][src][:, held]), (j, name)
            assert not decode[j][name][untouched].any()
    # Ranks that hold only replicas another rank sends hand their blocks back too.
    idle = [i for i in range(a) if not sends_of(i, kv_pieces(a, b, HEADS))]
    assert bool(idle) == (a > HEADS)
    wait_finished(pair.producers, job.req_id)


def test_a_released_transfer_drops_every_piece_staged_at_a_rank(pairs: list[Pair]) -> None:
    """The router's Release names the transfer; a decode rank drops all its pieces of it
    (two here, one from each prefill rank), and a piece arriving later is refused."""
    pair = start_pair("grpc", 2, 1)
    pairs.append(pair)
    full = model_cache(seed=3)
    prefill = [rank_cache(full, i, 2) for i in range(2)]
    for producer, cache in zip(pair.producers, prefill, strict=True):
        producer.register_kv_caches(cache)
    consumer = pair.consumers[0]
    consumer.register_kv_caches(rank_cache(None, 0, 1))
    tid = "tp-release"
    ship(pair, tid, [1, 2], prefill)
    pieces = [f"{tid}#0-0", f"{tid}#1-0"]
    deadline = time.monotonic() + 10
    while any(consumer.receiver.state(p) is not ReceiveState.COMPLETE for p in pieces):
        assert time.monotonic() < deadline, [consumer.receiver.state(p) for p in pieces]
        time.sleep(0.02)
    assert consumer.receiver.staged()[0] == 2
    consumer.receiver.discard(tid)
    assert consumer.receiver.staged() == (0, 0)
    assert all(consumer.receiver.state(p) is ReceiveState.UNKNOWN for p in pieces)
    # The same pieces again (a late sender): refused, so its blocks are freed at once.
    late = Producer(PREFILL, CFG, lease_s=5.0, allow_faults=False, shm=False, rank=1, tp=2)
    try:
        late.register_kv_caches(prefill[1])
        ship(Pair("grpc", [late], pair.consumers), tid, [1, 2], [prefill[1]])
        deadline = time.monotonic() + 10
        while f"req-{tid}" not in late.get_finished({f"req-{tid}"}):
            assert time.monotonic() < deadline, "the refused piece never ended"
            time.sleep(0.02)
        assert consumer.receiver.staged() == (0, 0)
    finally:
        late.close()


def test_a_corrupt_piece_fails_the_rank_that_needs_it_and_only_that_load(
        pairs: list[Pair]) -> None:
    """Prefill at TP=1 corrupts what it sends (fault injection) to decode at TP=2: each
    decode rank catches its own piece's checksum mismatch and reports the load failed
    (vLLM then recomputes or fails it, by policy); the prefill side frees its blocks."""
    pair = start_pair("grpc", 1, 2, allow_faults=True)
    pairs.append(pair)
    full = model_cache(seed=4)
    prefill = [rank_cache(full, 0, 1)]
    pair.producers[0].register_kv_caches(prefill[0])
    for j, consumer in enumerate(pair.consumers):
        consumer.register_kv_caches(rank_cache(None, j, 2))
    tid = "tp-corrupt"
    job = ship(pair, tid, [3, 4], prefill, fault=FAULT_CORRUPT_CHUNK)
    for consumer in pair.consumers:
        done, failed = load_until_done(consumer, LoadJob(f"dreq-{tid}", tid, [1, 2], 0))
        assert done == failed == {f"dreq-{tid}"}
        report = one_report(consumer)
        assert not report.ok and "checksum" in report.error
    wait_finished(pair.producers, job.req_id)
