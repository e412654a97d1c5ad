"""The precise prefix index: pure logic over KV cache events (the subscriber, fed over
gRPC, is tested in test_kv_events_relay.py; the engines' own events with real engines in
tests/integration)."""

from __future__ import annotations

import msgspec

from services.router.kv_index import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVIndex,
)
from services.router.prefix import block_hashes

BS = 4  # the engine's block size in these tests


def stored(vllm_hashes: list[int], tokens: list[int], parent: int | None = None,
           lora: str | None = None, block_size: int = BS, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=vllm_hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=block_size, medium=medium, lora_name=lora)


PROMPT = list(range(100, 117))  # 4 full blocks of 4, and one token more


def indexed(*events: object, worker: str = "w") -> KVIndex:
    index = KVIndex()
    index.track(worker, BS)
    index.apply(worker, 0, events)
    return index


def test_stored_blocks_are_found_by_prompt_at_the_engines_block_size() -> None:
    index = indexed(stored([11, 12], PROMPT[:8]))
    assert index.hits(["w"], PROMPT) == {"w": 8}
    assert index.hits(["w"], PROMPT[:7]) == {"w": 4}  # the second block is not full
    assert index.hits(["w"], [1, *PROMPT]) == {"w": 0}  # another prompt from token 0
    assert index.hits(["w", "untracked"], PROMPT) == {"w": 8}  # untracked: no answer


def test_later_blocks_chain_on_their_parent_and_an_unknown_parent_is_left_out() -> None:
    index = indexed(stored([11, 12], PROMPT[:8]), stored([13], PROMPT[8:12], parent=12))
    assert index.hits(["w"], PROMPT) == {"w": 12}
    index.apply("w", 1, [stored([99], PROMPT[12:16], parent=77)])  # 77: never seen here
    assert index.hits(["w"], PROMPT) == {"w": 12}


def test_an_adapters_blocks_are_apart_from_the_base_models() -> None:
    index = indexed(stored([11, 12], PROMPT[:8], lora="sql"))
    assert index.hits(["w"], PROMPT) == {"w": 0}
    assert index.hits(["w"], PROMPT, lora="sql") == {"w": 8}


def test_the_index_hashes_as_the_approximate_index_does() -> None:
    """One chained hash for both indexes: a block found by one is the block the other
    names (so the router's notion of a prompt's prefix does not depend on the mode)."""
    index = indexed(stored([11, 12], PROMPT[:8]))
    w = index._workers["w"]
    assert [h.hex() for h in w.held] == block_hashes(PROMPT, BS)[:2]


def test_removed_blocks_cut_the_prefix_and_a_duplicate_keeps_it() -> None:
    index = indexed(stored([11, 12, 13], PROMPT[:12]))
    index.apply("w", 1, [BlockRemoved(block_hashes=[12], medium="GPU")])
    assert index.hits(["w"], PROMPT) == {"w": 4}  # block 3 is held, but after a gap
    index = indexed(stored([11], PROMPT[:4]), stored([11], PROMPT[:4]))  # stored twice
    index.apply("w", 1, [BlockRemoved(block_hashes=[11], medium="GPU")])
    assert index.hits(["w"], PROMPT) == {"w": 4}
    index.apply("w", 2, [BlockRemoved(block_hashes=[11], medium="GPU")])
    assert index.hits(["w"], PROMPT) == {"w": 0}
    assert index.blocks("w") == 0


def test_all_cleared_and_a_sequence_gap_drop_the_workers_view() -> None:
    index = indexed(stored([11, 12], PROMPT[:8]))
    index.apply("w", 1, [AllBlocksCleared()])
    assert index.hits(["w"], PROMPT) == {"w": 0}
    index.apply("w", 2, [stored([11, 12], PROMPT[:8])])
    assert index.hits(["w"], PROMPT) == {"w": 8}
    index.apply("w", 5, [])  # batches 3 and 4 were lost: what they removed is unknown
    assert index.hits(["w"], PROMPT) == {"w": 0}
    assert index.tracking("w")  # still followed, from what comes next


def test_other_media_and_block_sizes_are_not_indexed() -> None:
    index = indexed(stored([11], PROMPT[:4], medium="CPU"),
                    stored([21, 22], PROMPT[:8], block_size=2))
    assert index.hits(["w"], PROMPT) == {"w": 0}


def test_workers_at_different_block_sizes_are_each_looked_up_at_their_own() -> None:
    index = KVIndex()
    index.track("small", 2)
    index.track("large", 8)
    index.apply("small", 0, [stored([1, 2, 3], PROMPT[:6], block_size=2)])
    index.apply("large", 0, [stored([9, 10], PROMPT[:16], block_size=8)])
    assert index.hits(["small", "large"], PROMPT) == {"small": 6, "large": 16}


def test_vllms_own_event_encoding_decodes() -> None:
    """The router decodes vLLM's wire format without importing vLLM: what vLLM's own
    classes encode (with the fields this index ignores) must decode to the same events."""
    from vllm.distributed import kv_events as vllm_events

    batch = vllm_events.KVEventBatch(ts=1.0, data_parallel_rank=0, events=[
        vllm_events.BlockStored(block_hashes=[b"\x01" * 32, 7], parent_block_hash=None,
                                token_ids=PROMPT[:8], block_size=BS, lora_id=None,
                                medium="GPU", lora_name=None, extra_keys=[None, None],
                                group_idx=0),
        vllm_events.BlockRemoved(block_hashes=[7], medium="GPU"),
        vllm_events.AllBlocksCleared()])
    ours = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode(batch))
    first, removed, cleared = ours.events
    assert isinstance(first, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert (first.block_hashes, first.token_ids, first.block_size) == (
        [b"\x01" * 32, 7], PROMPT[:8], BS)
    index = KVIndex()
    index.track("w", BS)
    index.apply("w", 0, batch.events[:1])  # vLLM's classes apply as well
    assert index.hits(["w"], PROMPT) == {"w": 8}
