"""Trace replay: the Azure and Mooncake parsers on small files in the traces' own shapes,
format detection, windows, time and rate scaling, length plans, hash id -> token blocks,
and the turn order of conversations."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from services.traffic.arrivals import TRACE, ArrivalConfig, schedule
from services.traffic.traces import (
    LengthPlan,
    ReplayConfig,
    TokenBlocks,
    TraceRecord,
    conversations,
    detect_format,
    parse_azure_time,
    plan_lengths,
    plan_replay,
    previous_turns,
    read_trace,
    sample_conversations,
    send_times,
    window,
)

# The first lines of the Azure 2023 conversation trace, as published.
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:51.3910170,91,16
2023-11-16 18:15:52.5732450,4200,300
"""

# Mooncake lines in the trace's shape: request 4 is a later turn of request 0 (it starts
# with all of request 0's blocks but its last, partial one), request 5 of request 4.
MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 1500, "output_length": 500, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [0, 3, 4]},
    {"timestamp": 1000, "input_length": 300, "output_length": 3, "hash_ids": [0]},
    {"timestamp": 2500, "input_length": 600, "output_length": 20, "hash_ids": [0, 5]},
    {"timestamp": 6000, "input_length": 2000, "output_length": 10, "hash_ids": [0, 1, 6, 7]},
    {"timestamp": 9000, "input_length": 2100, "output_length": 10,
     "hash_ids": [0, 1, 6, 7, 8]},
]


@pytest.fixture
def azure_file(tmp_path: Path) -> Path:
    path = tmp_path / "azure_conv.csv"
    path.write_text(AZURE)
    return path


@pytest.fixture
def mooncake_file(tmp_path: Path) -> Path:
    path = tmp_path / "conversation.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in MOONCAKE_ROWS))
    return path


def test_formats_are_recognised_by_content(azure_file: Path, mooncake_file: Path,
                                           tmp_path: Path) -> None:
    assert detect_format(azure_file) == "azure"
    assert detect_format(mooncake_file) == "mooncake"
    renamed = tmp_path / "trace.txt"
    renamed.write_text(mooncake_file.read_text())
    assert read_trace(renamed).format == "mooncake"
    other = tmp_path / "other.csv"
    other.write_text("time,prompt\n1,2\n")
    with pytest.raises(ValueError, match="--trace-format"):
        detect_format(other)


def test_azure_timestamps_keep_their_seven_fraction_digits() -> None:
    a = parse_azure_time("2023-11-16 18:15:46.6805900")
    b = parse_azure_time("2023-11-16 18:15:50.9951690")
    assert b - a == pytest.approx(4.314579, abs=1e-6)
    assert parse_azure_time("2024-05-10 00:00:00.5+00:00") - parse_azure_time(
        "2024-05-10 00:00:00") == pytest.approx(0.5)


def test_azure_parser(azure_file: Path) -> None:
    trace = read_trace(azure_file)
    assert trace.format == "azure" and len(trace.records) == 5
    first, second = trace.records[:2]
    assert (first.t_s, first.input_len, first.output_len, first.hash_ids) == (0.0, 374, 44, ())
    assert second.t_s == pytest.approx(4.314579, abs=1e-6) and second.line == 3


def test_mooncake_parser(mooncake_file: Path) -> None:
    trace = read_trace(mooncake_file, "mooncake")
    assert [r.t_s for r in trace.records] == [0.0, 0.0, 1.0, 2.5, 6.0, 9.0]
    assert trace.records[4].hash_ids == (0, 1, 6, 7)
    assert trace.records[0].input_len == 1500 and trace.records[0].output_len == 500


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}',
     "do not cover"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length must be"),
    ('{"timestamp": 0, "output_length": 1}', "bad Mooncake trace line"),
])
def test_bad_mooncake_lines_are_named_by_line(tmp_path: Path, line: str, message: str,
                                              ) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MOONCAKE_ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        read_trace(path, "mooncake")
    assert "bad.jsonl:2" in str(err.value)


def test_a_bad_azure_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(AZURE + "2023-11-16 18:16:00.1,twelve,3\n")
    with pytest.raises(ValueError, match=r"bad\.csv:7"):
        read_trace(path)


def test_window_by_time_and_count(mooncake_file: Path) -> None:
    records = read_trace(mooncake_file).records
    assert [r.t_s for r in window(records, 1.0, 5.0)] == [1.0, 2.5]  # [1, 6)
    assert len(window(records, max_requests=2)) == 2
    assert [r.t_s for r in window(records, 2.0, max_requests=2)] == [2.5, 6.0]
    with pytest.raises(ValueError, match=r"the trace spans 0-9\.0 s"):
        window(records, 50.0)


def test_speed_divides_the_gaps_and_a_rate_stretches_them(mooncake_file: Path) -> None:
    records = window(read_trace(mooncake_file).records, 1.0)
    assert send_times(records).tolist() == [0.0, 1.5, 5.0, 8.0]  # from the window's first
    assert send_times(records, speed=2.0).tolist() == [0.0, 0.75, 2.5, 4.0]
    at_rate = send_times(records, rate=0.5)  # 4 requests: the last at 3 / 0.5 s
    assert at_rate[-1] == pytest.approx(6.0)
    assert at_rate.tolist() == pytest.approx([0.0, 1.125, 3.75, 6.0])  # gaps in proportion
    with pytest.raises(ValueError, match="did not all arrive at once"):
        send_times([TraceRecord(0.0, 1, 1), TraceRecord(0.0, 1, 1)], rate=1.0)


def test_later_turns_follow_the_request_they_repeat(mooncake_file: Path) -> None:
    records = read_trace(mooncake_file).records
    # 4 starts with 0's blocks but the last; 5 with all of 4's; 1 and 3 share only the
    # system block 0 with 0, which does not make them turns of one conversation.
    assert previous_turns(records) == [None, None, None, None, 0, 4]


def test_token_blocks_are_the_same_for_the_same_id_and_seed() -> None:
    pool = np.arange(100, 1100)
    blocks = TokenBlocks(pool, 16, seed=3)
    again = TokenBlocks(pool, 16, seed=3)
    assert blocks.block(7) == again.block(7)
    assert len(blocks.block(7)) == 16 and set(blocks.block(7)) <= set(pool.tolist())
    assert blocks.block(7) != blocks.block(8)
    assert TokenBlocks(pool, 16, seed=4).block(7) != blocks.block(7)
    prompt = blocks.prompt([5, 7, 9], 40)
    assert prompt == blocks.block(5) + blocks.block(7) + blocks.block(9)[:8]
    with pytest.raises(ValueError, match="cannot make a 49-token prompt"):
        blocks.prompt([5, 7, 9], 49)


def test_length_plans() -> None:
    auto = plan_lengths("mooncake", [], 2048, None, kv_block_size=128)
    assert (auto.factor, auto.block_tokens) == (0.25, 128)  # one trace block, one KV block
    # 0.1 * 512 = 51 tokens: the nearest whole number of 16-token blocks is 3
    assert plan_lengths("mooncake", [], 2048, 0.1, kv_block_size=16).block_tokens == 48
    assert plan_lengths("mooncake", [], 2048, 0.01, kv_block_size=16).block_tokens == 16
    records = [TraceRecord(0.0, 3000, 1000)] * 99 + [TraceRecord(0.0, 10, 10)]
    azure = plan_lengths("azure", records, 2000, None)
    assert azure.factor == pytest.approx(0.5)  # the 99th percentile, 4000, fits 2000
    assert plan_lengths("azure", [TraceRecord(0.0, 10, 10)], 2000, None).factor == 1.0

    plan = LengthPlan(0.25, 1000, 128)
    # 2000 tokens in 4 blocks of 512 -> 500 in 4 blocks of 128 (rounded up, never fewer)
    assert plan.scale(TraceRecord(0.0, 2000, 400)) == (500, 100, False)
    assert plan.scale(TraceRecord(0.0, 1537, 1)) == (385, 1, False)
    # too long: the output is capped at half the context, the prompt cut to the rest
    assert plan.scale(TraceRecord(0.0, 4000, 4000)) == (500, 500, True)
    assert plan.scale(TraceRecord(0.0, 8000, 40)) == (990, 10, True)


def test_a_mooncake_replay_shares_exactly_the_traces_prefixes(mooncake_file: Path) -> None:
    pool = np.arange(1000)
    cfg = ReplayConfig(str(mooncake_file), max_model_len=1024, kv_block_size=32,
                       length_scale=1 / 16, speed=2.0, seed=5)
    replay = plan_replay(cfg, pool)
    specs = replay.specs
    assert replay.lengths.block_tokens == 32
    assert [len(s.prompt_ids) for s in specs] == [94, 69, 19, 38, 125, 132]
    assert [s.output_len for s in specs] == [31, 2, 1, 1, 1, 1]
    # block 0 (the system prompt) is the same 32 tokens at the head of every prompt (the
    # 19-token prompt of request 2 is its first 19)
    head = specs[0].prompt_ids[:32]
    assert all(s.prompt_ids[:32] == head[:len(s.prompt_ids)] for s in specs)
    # request 4 = [0, 1, 6, 7] shares blocks 0 and 1 with request 0 and no more
    assert specs[4].prompt_ids[:64] == specs[0].prompt_ids[:64]
    assert specs[4].prompt_ids[64:94] != specs[0].prompt_ids[64:94]
    # request 5 repeats all of request 4's prompt
    assert specs[5].prompt_ids[:125] == specs[4].prompt_ids
    assert [s.after for s in specs] == [None, None, None, None, 0, 4]
    assert [s.kind for s in specs][4:] == ["mooncake-next-turn"] * 2
    assert [s.at_s for s in specs] == [0.0, 0.0, 0.5, 1.25, 3.0, 4.5]
    assert replay.description["prefix_reuse"]["reused_blocks"] == 9  # 0 x5, 1 x2, 6, 7
    assert replay.description["turns"]["next_turn_requests"] == 2
    # another seed: the same shape, other tokens
    other = plan_replay(replace(cfg, seed=6), pool).specs
    assert [len(s.prompt_ids) for s in other] == [len(s.prompt_ids) for s in specs]
    assert other[0].prompt_ids != specs[0].prompt_ids
    assert other[4].prompt_ids[:64] == other[0].prompt_ids[:64]


def test_an_azure_replay_has_no_shared_prefixes_and_no_turns(azure_file: Path) -> None:
    replay = plan_replay(ReplayConfig(str(azure_file), max_model_len=2048, rate=2.0),
                         np.arange(5000))
    specs = replay.specs
    assert replay.lengths.factor == pytest.approx(2048 / np.percentile(
        [418, 505, 934, 107, 4500], 99))
    assert all(s.after is None for s in specs)
    assert len({tuple(s.prompt_ids[:8]) for s in specs}) == len(specs)
    assert specs[-1].at_s == pytest.approx(4 / 2.0)
    assert replay.mean_rate == pytest.approx(2.0)
    assert "prefix_reuse" not in replay.description
    assert replay.description["turns"]["ordering"].startswith("no session ids")


def test_turn_order_can_be_switched_off(mooncake_file: Path) -> None:
    cfg = ReplayConfig(str(mooncake_file), max_model_len=4096, keep_turn_order=False)
    assert all(s.after is None for s in plan_replay(cfg, np.arange(100)).specs)


def test_speed_and_rate_together_are_refused(mooncake_file: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        plan_replay(ReplayConfig(str(mooncake_file), speed=2.0, rate=1.0), np.arange(10))


def test_trace_arrivals_are_the_requests_own_times(mooncake_file: Path) -> None:
    specs = plan_replay(ReplayConfig(str(mooncake_file), max_model_len=4096),
                        np.arange(100)).specs
    cfg = ArrivalConfig(rate=1.0, process=TRACE)
    assert schedule(cfg, specs, len(specs)).tolist() == [0.0, 0.0, 1.0, 2.5, 6.0, 9.0]
    cut = ArrivalConfig(rate=1.0, process=TRACE, duration_s=3.0)
    assert schedule(cut, specs, len(specs)).tolist() == [0.0, 0.0, 1.0, 2.5]
    assert schedule(cfg, specs, 3).tolist() == [0.0, 0.0, 1.0]


def test_conversations_are_sampled_whole(mooncake_file: Path) -> None:
    records = read_trace(mooncake_file).records
    assert conversations(records) == [0, 1, 2, 3, 0, 0]
    picked = {tuple(r.hash_ids) for r in sample_conversations(records, 5, seed=0)}
    assert len(picked) == 6  # five conversations are every request
    for seed in range(8):  # whichever are drawn, a conversation comes with all its turns
        sample = sample_conversations(records, 2, seed=seed)
        has_first = (0, 1, 2) in {r.hash_ids for r in sample}
        turns = sum(r.hash_ids[:2] == (0, 1) for r in sample)
        assert turns == (3 if has_first else 0)
        assert [r.t_s for r in sample] == sorted(r.t_s for r in sample)
    cfg = ReplayConfig(str(mooncake_file), max_model_len=4096, conversations=1,
                       sample_seed=1)
    assert plan_replay(cfg, np.arange(100)).description["window"]["conversations"] == 1


def test_only_a_mooncake_trace_is_sampled_by_conversation(azure_file: Path) -> None:
    with pytest.raises(ValueError, match="sample an Azure trace by its window"):
        plan_replay(ReplayConfig(str(azure_file), conversations=2), np.arange(100))


def test_trace_prompts_draw_from_streams_of_their_own(azure_file: Path) -> None:
    """numpy seeds [s] and [s, 0] are one stream: without a tag of its own, block 0 at
    seed s would be the random workload's (or an Azure replay's) first tokens at seed s,
    and a replay would find a cache hit another run left."""
    pool = np.arange(5000)
    plain = [int(t) for t in np.random.default_rng(3).choice(pool, 16)]
    assert TokenBlocks(pool, 16, seed=3).block(0) != plain
    azure = plan_replay(ReplayConfig(str(azure_file), max_model_len=8192, seed=3), pool)
    assert azure.specs[0].prompt_ids[:16] != plain
    assert azure.specs[0].prompt_ids[:16] != TokenBlocks(pool, 16, seed=3).block(0)
