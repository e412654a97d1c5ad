"""The bench harness end to end: real runs over real sockets on 127.0.0.1 against the
SIMULATED servers (gRPC and OpenAI SSE), each started as its own process, and against a
real disaggregated stack (vLLM engines, KV shipped over gRPC)."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from services.bench import cli
from services.bench.report import read_records_jsonl
from tests.helpers.servers import DisaggStack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
WORDS = ("hello", "world", "how", "are", "you", "today", "the", "a", "is", "fine")


@contextmanager
def simulator(*args: str) -> Iterator[int]:
    """Starts ``python -m services.bench.simulator`` on a free port; yields the port."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "proto"), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.bench.simulator", "--port", "0", *args],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "... listening on HOST:PORT" once it serves
        assert "listening on" in line, f"simulator did not start: {line!r}"
        yield int(line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def make_tiny_tokenizer(folder: Path) -> Path:
    """A real word-level Hugging Face tokenizer folder for AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<s>", "</s>", *WORDS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[UNK]", "<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}))
    return folder


def check_output_files(out: Path, runs: int, requests: int) -> dict:  # type: ignore[type-arg]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == runs
    with (out / "summary.csv").open() as f:
        assert len(list(csv.DictReader(f))) == runs
    with (out / "requests.csv").open() as f:
        assert len(list(csv.DictReader(f))) == requests
    assert len(read_records_jsonl(out / "requests.jsonl")) == requests
    pngs = list((out / "plots").glob("*.png"))
    assert pngs and all(p.read_bytes()[:8] == PNG for p in pngs)
    assert (out / "report.html").read_text().count("data:image/png;base64,") == len(pngs)
    return summary  # type: ignore[no-any-return]


def test_grpc_run_against_the_simulator(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        ) -> None:
    out = tmp_path / "grpc"
    with simulator("--ttft-s", "0.02", "--tpot-s", "0.002", "--disaggregated",
                   "--fail-every", "10") as port:
        rc = cli.main(["bench", "run", "--address", f"127.0.0.1:{port}", "--vocab-size", "500",
                       "--num-requests", "30", "--rate", "100", "--input-len", "64",
                       "--output-len", "10", "--warmup-requests", "2", "--slo", "ttft=1",
                       "--slo", "tpot=0.5", "--output-dir", str(out), "--no-progress"])
    assert rc == 0
    assert "results:" in capsys.readouterr().out
    run = check_output_files(out, runs=1, requests=30)["runs"][0]
    records = read_records_jsonl(out / "requests.jsonl")
    failed = [r for r in records if not r.ok]
    assert len(failed) == 3 and {r.error_code for r in failed} == {"RESOURCE_EXHAUSTED"}
    assert run["requests"] == 28 and run["warmup_requests"] == 2
    assert run["completed"] + run["failed"] == 28
    assert run["good_requests"] == run["completed"]
    for r in (r for r in records if r.ok):
        assert r.output_tokens == 10 and sum(r.chunk_tokens) == 10
        assert r.finish_reason == "length" and r.server is not None
        assert r.ttft_s is not None and r.ttft_s >= 0.02
        assert r.e2e_s is not None and r.e2e_s >= r.chunk_offsets[-1]
    assert run["tpot_s"]["p50"] == pytest.approx(0.002 * (1 + 3 / 9), abs=0.002)
    assert run["anatomy"]["kv_transfer"]["mean"] == pytest.approx(0.004)
    assert run["anatomy"]["prefill"]["mean"] > 0.01
    assert run["input_tokens"] == 64 * run["completed"]


def test_openai_sweep_with_text_prompts_then_compare(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nhow are you today\nthe a is\n")
    tok = make_tiny_tokenizer(tmp_path / "tok")
    out = tmp_path / "openai"
    with simulator("--protocol", "openai", "--ttft-s", "0.01", "--tpot-s", "0.001") as port:
        rc = cli.main(["bench", "sweep", "--target", "openai",
                       "--base-url", f"http://127.0.0.1:{port}/v1", "--dataset", "prompts",
                       "--dataset-path", str(prompts), "--tokenizer", str(tok),
                       "--prompt-as", "text", "--num-requests", "12", "--rates", "50", "inf",
                       "--max-concurrency", "4", "--output-len", "8",
                       "--output-dir", str(out), "--no-progress"])
    assert rc == 0
    summary = check_output_files(out, runs=2, requests=24)
    assert [r["label"] for r in summary["runs"]] == ["rate-50", "rate-inf"]
    for run in summary["runs"]:
        assert run["completed"] == 12 and run["errors"] == {}
        assert run["anatomy"] is None  # no server timings over OpenAI
        assert run["output_tokens"] == 12 * 8
    records = read_records_jsonl(out / "requests.jsonl")
    assert {r.prompt_tokens for r in records} == {2, 3, 4}  # counted by the tokenizer
    assert all(len(r.chunk_offsets) == 8 for r in records)
    capsys.readouterr()
    rc = cli.main(["bench", "compare", str(out / "summary.json"), str(out / "summary.json"),
                   "--output-dir", str(tmp_path / "cmp")])
    assert rc == 0
    assert "| requests/s |" in capsys.readouterr().out
    assert (tmp_path / "cmp" / "compare.html").exists()


def test_duration_limit_stops_the_run_and_cancels_in_flight(tmp_path: Path) -> None:
    out = tmp_path / "bounded"
    with simulator("--tpot-s", "0.05") as port:
        started = time.monotonic()
        rc = cli.main(["bench", "run", "--address", f"127.0.0.1:{port}", "--vocab-size", "50",
                       "--rate", "inf", "--max-concurrency", "3", "--duration", "0.5",
                       "--drain-timeout", "0.5", "--output-len", "200", "--no-plots",
                       "--output-dir", str(out), "--no-progress"])
        elapsed = time.monotonic() - started
    assert rc == 1  # nothing completed
    assert elapsed < 5.0  # 200 tokens at 0.05 s would take 10 s
    records = read_records_jsonl(out / "requests.jsonl")
    assert len(records) == 3
    assert {r.error_code for r in records} == {"CANCELLED_BY_CLIENT"}
    assert all(len(r.chunk_offsets) >= 10 for r in records)  # they were streaming


def test_unreachable_server_is_reported_per_request(tmp_path: Path) -> None:
    out = tmp_path / "down"
    rc = cli.main(["bench", "run", "--address", "127.0.0.1:1", "--vocab-size", "50",
                   "--num-requests", "2", "--no-plots", "--output-dir", str(out),
                   "--no-progress", "--request-timeout", "5"])
    assert rc == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"][0]["errors"] == {"UNAVAILABLE": 2}


@pytest.mark.timeout(300)
def test_load_spread_over_ray_actors_is_one_run(tmp_path: Path) -> None:
    """Two Ray actors each send half of one schedule; the records merge into one run."""
    from services.traffic.arrivals import ArrivalConfig, send_offsets

    out = tmp_path / "ray"
    with simulator("--ttft-s", "0.01", "--tpot-s", "0.002") as port:
        rc = cli.main(["bench", "run", "--address", f"127.0.0.1:{port}", "--vocab-size", "500",
                       "--num-requests", "40", "--rate", "20", "--arrival", "constant",
                       "--input-len", "32", "--output-len", "5", "--generators", "2",
                       "--output-dir", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    run = summary["runs"][0]
    assert run["completed"] == 40 and run["failed"] == 0
    assert summary["meta"]["generators"] == 2
    records = read_records_jsonl(out / "requests.jsonl")
    assert [r.index for r in records] == list(range(40))
    by_generator = {g: [r.index for r in records if r.generator == g]
                    for g in {r.generator for r in records}}
    assert sorted(map(sorted, by_generator.values())) == [list(range(0, 40, 2)),
                                                          list(range(1, 40, 2))]
    # the schedule is the one a single process would have sent, from one shared start
    expected = send_offsets(ArrivalConfig(rate=20, process="constant"), 40)
    assert [r.scheduled_s for r in records] == pytest.approx(expected.tolist())
    first = min(r.send_time for r in records)
    for r in records:
        assert r.send_time - first == pytest.approx(r.scheduled_s - expected[0], abs=0.25)


def test_a_served_model_without_a_local_tokenizer_asks_for_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    with simulator() as port:  # serves a model named "simulated": no folder of that name
        rc = cli.main(["bench", "run", "--address", f"127.0.0.1:{port}", "--num-requests", "1",
                       "--no-progress", "--no-plots"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "serves model 'simulated'" in err and "pass --tokenizer MODEL_DIR" in err


def test_generators_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["bench", "run", "--generators", "0", "--vocab-size", "10",
                   "--num-requests", "1", "--no-progress"])
    assert rc == 2 and "--generators must be >= 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
async def stack(model_path: Path, session_dir: Path) -> AsyncIterator[DisaggStack]:
    """A disaggregated stack whose engine steps hold at most 256 prompt tokens, as
    `pdserve up` bounds them on a CPU host: prompts that arrive together queue for the
    prefill engine instead of being prefilled in one step."""
    stack = DisaggStack.create(session_dir / "bench-disagg.log", "grpc", "--no-pin-scheduler",
                               "--max-num-batched-tokens", "256")
    async with stack.server.running(timeout=600):
        yield stack


async def bench(*argv: str) -> tuple[int, str]:
    """`pdserve bench ...` in a thread (it runs its own event loop); exit code and what
    it printed."""
    import contextlib
    import io

    out = io.StringIO()

    def go() -> int:
        with contextlib.redirect_stdout(out):
            return cli.main(["bench", *argv, "--no-progress", "--no-plots"])

    return await asyncio.to_thread(go), out.getvalue()


@pytest.mark.engine
@pytest.mark.timeout(900)
async def test_a_light_run_on_a_real_stack(stack: DisaggStack, model_path: Path,
                                           tmp_path: Path) -> None:
    """No --tokenizer: the served model's. Distinct random prompts: no prefix-cache hit,
    so `cached_tokens` is 0 although the decode engine received every prompt's KV. A
    rate the stack keeps up with, even on a host busy with other work (a request every
    2 s, each a few forward passes): no overload warning."""
    out = tmp_path / "light"
    rc, printed = await bench(
        "run", "--address", stack.server.target, "--input-len", "64", "--output-len", "4",
        "--rate", "0.5", "--arrival", "constant", "--num-requests", "10", "--seed", "11",
        "--output-dir", str(out))
    assert rc == 0, printed
    assert "warning" not in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["tokenizer"] == str(model_path)
    assert summary["meta"]["model"] == model_path.name  # pdserve serves it by that name
    assert summary["meta"]["label"] == "pdserve-random-64in-4out"
    run = summary["runs"][0]
    assert run["completed"] == 10 and not run["overload"]["overloaded"]
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10
    assert all(int(r["server_kv_transfer_bytes"]) > 0 for r in rows)  # the KV was shipped
    assert [int(r["cached_tokens"]) for r in rows] == [0] * 10


@pytest.mark.engine
async def test_the_openai_target_defaults_to_the_served_models_tokenizer(
        stack: DisaggStack, model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "openai"
    rc, printed = await bench(
        "run", "--target", "openai", "--base-url", stack.server.base_url,
        "--input-len", "16", "--output-len", "2", "--num-requests", "2", "--seed", "12",
        "--output-dir", str(out))
    assert rc == 0, printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["tokenizer"] == str(model_path)
    assert summary["runs"][0]["completed"] == 2


@pytest.mark.engine
async def test_a_rate_beyond_the_stack_warns(stack: DisaggStack, tmp_path: Path) -> None:
    """Prompts arriving far faster than one prefill engine computes them: the backlog
    grows over the run, and the run says so on the console and in summary.json."""
    out = tmp_path / "heavy"
    rc, printed = await bench(
        "run", "--address", stack.server.target, "--input-len", "128", "--output-len", "2",
        "--rate", "200", "--arrival", "constant", "--num-requests", "24", "--seed", "13",
        "--output-dir", str(out))
    assert rc == 0, printed
    warnings = [line for line in printed.splitlines() if "warning" in line]
    assert len(warnings) == 1, printed
    assert warnings[0].strip().startswith("warning: the offered load exceeded")
    overload = json.loads((out / "summary.json").read_text())["runs"][0]["overload"]
    assert overload["overloaded"] and overload["served_share"] < 0.8
