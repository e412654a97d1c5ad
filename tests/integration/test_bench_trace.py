"""`pdserve bench run --trace`: replays over real sockets, against the SIMULATED gRPC
server (turn order, time scaling, repeated runs) and against a real colocated stack, where
the trace's shared Mooncake blocks are real shared prefixes that the engine's prefix cache
serves."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.bench import cli
from services.bench.report import read_records_jsonl
from tests.helpers.servers import ServerProcess
from tests.integration.test_bench_harness import check_output_files, simulator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_bench(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["bench", "run", *argv, "--no-progress"])
    return rc, out.getvalue()


def test_a_later_turn_waits_for_the_turn_before(tmp_path: Path) -> None:
    """Request 1 continues request 0's conversation and is due 0.1 s after it, but
    request 0 streams for about a second: request 1 leaves when request 0 has ended.
    Request 2, of no conversation, leaves at its own time."""
    trace = write_jsonl(tmp_path / "conv.jsonl", [
        {"timestamp": 0, "input_length": 1000, "output_length": 80, "hash_ids": [0, 1]},
        {"timestamp": 100, "input_length": 1400, "output_length": 4, "hash_ids": [0, 1, 2]},
        {"timestamp": 200, "input_length": 300, "output_length": 4, "hash_ids": [7]},
    ])
    out = tmp_path / "turns"
    with simulator("--ttft-s", "0.01", "--tpot-s", "0.05") as port:
        rc, printed = run_bench("--address", f"127.0.0.1:{port}", "--vocab-size", "500",
                                "--trace", str(trace), "--max-model-len", "4096",
                                "--output-dir", str(out))
    assert rc == 0, printed
    first, second, third = read_records_jsonl(out / "requests.jsonl")
    assert first.output_tokens == 20  # 80 x 0.25 (one 512-token block -> 128 tokens)
    assert first.e2e_s is not None and first.e2e_s > 0.5
    assert second.send_time >= first.send_time + first.e2e_s - 0.01
    assert second.scheduled_s > 0.5 and second.kind == "mooncake-next-turn"
    assert third.send_time - first.send_time == pytest.approx(0.2, abs=0.15)
    summary = check_output_files(out, runs=1, requests=3)
    assert summary["meta"]["trace"]["turns"]["next_turn_requests"] == 1
    assert "1 later turns" in printed


def test_an_azure_replay_at_a_target_rate_repeated(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + 2 * i:02d}.5000000,{100 + 10 * i},{5 + i}\n"
        for i in range(10)))
    out = tmp_path / "azure"
    with simulator("--ttft-s", "0.01", "--tpot-s", "0.002") as port:
        rc, printed = run_bench("--address", f"127.0.0.1:{port}", "--vocab-size", "500",
                                "--trace", str(trace), "--trace-rate", "20",
                                "--trace-start", "4", "--num-requests", "6",
                                "--max-model-len", "2048", "--runs", "2",
                                "--output-dir", str(out))
    assert rc == 0, printed
    summary = check_output_files(out, runs=1, requests=12)
    run = summary["runs"][0]
    assert run["label"] == "trace-rate-20" and run["repeats"] == 2
    assert len(run["repetitions"]) == 2 and "ttft_s.p50" in run["intervals"]
    records = read_records_jsonl(out / "requests.jsonl")
    first_run = [r for r in records if r.run == "trace-rate-20/run-1"]
    # the window from 4 s: requests 2..7, their gaps stretched to 20 requests/s
    assert [r.scheduled_s for r in first_run] == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2,
                                                                0.25])
    assert [r.prompt_tokens for r in first_run] == [120, 130, 140, 150, 160, 170]
    assert summary["meta"]["trace"]["lengths"]["factor"] == 1.0
    assert "medians of 2 runs" in printed


def test_generated_traffic_flags_are_refused_with_a_trace(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         ) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}])
    rc = cli.main(["bench", "run", "--trace", str(trace), "--rate", "2", "--vocab-size",
                   "10", "--no-progress"])
    assert rc == 2 and "--trace-rate" in capsys.readouterr().err


# --- a real stack -------------------------------------------------------------------

# Mooncake-shaped: request 1 is the next turn of request 0 (three shared 512-token
# blocks), request 2 starts with the same system block 0, request 3 shares nothing.
PREFIX_TRACE = [
    {"timestamp": 0, "input_length": 1500, "output_length": 8, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1800, "output_length": 8, "hash_ids": [0, 1, 2, 3]},
    {"timestamp": 1000, "input_length": 700, "output_length": 8, "hash_ids": [0, 9]},
    {"timestamp": 1500, "input_length": 700, "output_length": 8, "hash_ids": [20, 21]},
]


@pytest.fixture(scope="module")
async def colocated_stack(model_path: Path, session_dir: Path,
                          ) -> AsyncIterator[ServerProcess]:
    """A colocated engine with prefix caching on (pdserve's default)."""
    server = ServerProcess(["--mode", "colocated", "--kv-cache-gib", "1"],
                           session_dir / "bench-trace-colocated.log")
    async with server.running(timeout=600):
        yield server


@pytest.mark.engine
@pytest.mark.timeout(900)
async def test_shared_trace_blocks_hit_the_prefix_cache(colocated_stack: ServerProcess,
                                                        tmp_path: Path) -> None:
    """At the default scale one trace block is one 128-token KV block: request 1 finds
    the two whole KV blocks of request 0's 375-token prompt, request 2 the system block;
    the unrelated request 3 finds nothing. The second repetition draws other tokens for
    the same ids, so it hits only within itself, never the first repetition's blocks."""
    trace = write_jsonl(tmp_path / "prefix.jsonl", PREFIX_TRACE)
    out = tmp_path / "real"
    rc, printed = await asyncio.to_thread(
        run_bench, "--address", colocated_stack.target, "--trace", str(trace),
        "--runs", "2", "--no-plots", "--output-dir", str(out))
    assert rc == 0, printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["trace"]["lengths"]["max_model_len"] == 2048  # the server's
    records = read_records_jsonl(out / "requests.jsonl")
    for k in (1, 2):
        run = sorted((r for r in records if r.run == f"speed-1/run-{k}"), key=lambda r: r.index)
        assert all(r.ok for r in run), [r.error_message for r in run]
        assert [r.prompt_tokens for r in run] == [375, 450, 175, 175]
        assert [r.cached_tokens for r in run] == [0, 256, 128, 0]
    assert summary["runs"][0]["repeats"] == 2
