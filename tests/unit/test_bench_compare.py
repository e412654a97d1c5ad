"""`pdserve bench compare` on unlike runs, and the default run label (no network)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from services.bench import cli
from services.bench.compare import compare_table, differences, load_summary
from services.bench.report import write_report
from services.traffic.slo import SLOs
from tests.unit.test_bench_report import fake_run, make_parser


def summary_of(
    tmp_path: Path, name: str, argv: list[str], slos: SLOs | None = None, rate: float = 1.0
) -> dict:  # type: ignore[type-arg]
    args = make_parser().parse_args(["bench", "run", "--vocab-size", "100", *argv])
    wcfg = cli.workload_config(args, args.num_requests or 200)
    meta = {
        "label": cli.default_label("pdserve", wcfg),
        "num_requests": args.num_requests,
        "prompt_as": args.prompt_as,
        "workload": asdict(wcfg),
    }
    write_report(
        tmp_path / name,
        [fake_run(f"rate-{rate:g}", rate, 0.1)],
        slos or SLOs(),
        meta,
        with_plots=False,
    )
    return load_summary(tmp_path / name / "summary.json")


def test_unlike_workloads_and_slos_are_warned_about_first(tmp_path: Path) -> None:
    a = summary_of(
        tmp_path, "a", ["--input-len", "200", "--output-len", "32", "--num-requests", "50"]
    )
    b = summary_of(
        tmp_path,
        "b",
        ["--input-len", "1000", "--output-len", "64", "--num-requests", "100"],
        SLOs(ttft_s=5, tpot_s=0.2),
    )
    lines = differences(a, b)
    assert "input length (tokens): A 200, B 1000" in lines
    assert "output length (tokens): A 32, B 64" in lines
    assert "requests: A 50, B 100" in lines
    assert "goodput SLOs (s): A none, B ttft=5, tpot=0.2" in lines
    table = compare_table(a, b)
    assert table.startswith("warning: A and B differ in workload or SLOs")
    assert table.index("warning:") < table.index("| requests/s |")
    assert "A: pdserve-random-200in-32out" in table


def test_a_different_rate_is_a_different_workload(tmp_path: Path) -> None:
    a = summary_of(tmp_path, "a", ["--num-requests", "6"], rate=1.0)
    b = summary_of(tmp_path, "b", ["--num-requests", "6"], rate=2.0)
    assert differences(a, b) == ["request rate (req/s): A 1, B 2"]


def test_like_runs_compare_without_a_warning(tmp_path: Path) -> None:
    a = summary_of(tmp_path, "a", ["--num-requests", "6"], SLOs(ttft_s=1))
    b = summary_of(tmp_path, "b", ["--num-requests", "6"], SLOs(ttft_s=1))
    assert differences(a, b) == []
    assert "warning" not in compare_table(a, b)


def test_summaries_without_meta_still_compare(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write_report(tmp_path / name, [fake_run("rate-1", 1.0, 0.1)], SLOs(), {}, with_plots=False)
    a, b = (load_summary(tmp_path / n / "summary.json") for n in ("a", "b"))
    assert differences(a, b) == [] and "| requests/s |" in compare_table(a, b)


def test_default_label_names_target_and_workload() -> None:
    def label(*argv: str) -> str:
        args = make_parser().parse_args(["bench", "run", *argv])
        return cli.default_label("openai", cli.workload_config(args, 10))

    assert label("--input-len", "256", "--output-len", "32") == "openai-random-256in-32out"
    assert label("--dataset", "mixed", "--long-share", "0.2") == "openai-mixed-256in-128out-0.2long"
    assert label("--dataset", "sharegpt", "--dataset-path", "data/sg.json") == "openai-sharegpt-sg"
