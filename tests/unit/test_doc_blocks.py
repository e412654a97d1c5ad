"""Every code block of README.md and docs/*.md either runs in
tests/integration/test_doc_blocks.py or is marked as not run here, with why (the marker
convention: tests/helpers/doc_blocks.py, docs/getting-started.md "Development")."""

from __future__ import annotations

import yaml

from services.config_file import parse_config
from tests.helpers.doc_blocks import collect, expected_outputs, parse, problems, shape_mismatch


def test_every_block_runs_or_says_why_not() -> None:
    blocks, wrong = collect()
    wrong += problems(blocks)
    assert not wrong, "\n".join(wrong)
    assert any(b.runs for b in blocks) and any(not b.runs for b in blocks)


def test_an_unmarked_block_is_named_by_file_and_line() -> None:
    text = "# Page\n\n```\nsample output\n```\n\n```yaml\na: 1\n```\n\n```bash\ntrue\n```\n"
    blocks, wrong = parse(text, "docs/page.md")
    assert wrong == []
    assert [(b.line, b.lang, b.runs) for b in blocks] == [(3, "", False), (7, "yaml", False),
                                                        (11, "bash", True)]
    found = problems(blocks)
    assert [p.split(": ", 1)[0] for p in found] == ["docs/page.md:3", "docs/page.md:7"]
    assert "not-run: REASON" in found[0]


def test_markers() -> None:
    text = ("<!-- not-run: output of the block above -->\n```\nx\n```\n\n"
            "<!-- not-run: needs a\nKubernetes cluster -->\n```bash\nkubectl get pods\n```\n\n"
            "<!-- run-with: `--num-requests 100` -> `--num-requests 5`: a shorter run -->\n"
            "```bash\npdserve bench run --num-requests 100\n```\n\n"
            "<!-- not-run: -->\n```bash\ntrue\n```\n\n"
            "<!-- run-with: `absent` -> `x`: why -->\n```bash\ntrue\n```\n\n"
            "<!-- not-run: a marker with a blank line after it -->\n\n```bash\ntrue\n```\n")
    blocks, wrong = parse(text, "p.md")
    output, cluster, shorter, _, _, loose = blocks
    assert (output.marker, output.runs) == ("not-run", False)
    assert cluster.reason == "needs a Kubernetes cluster" and not cluster.runs
    assert shorter.runs and shorter.script == "pdserve bench run --num-requests 5\n"
    assert loose.marker == "" and loose.runs
    assert wrong == ["p.md:27: a marker not on the line right before a code block's fence"]
    assert problems(blocks) == ["p.md:18: `not-run` without a reason",
                                "p.md:23: `run-with`: `absent` is not in the block"]


def test_an_output_block_is_matched_line_by_line_numbers_aside() -> None:
    text = ("```bash\nmake run\n```\n\n<!-- not-run: output of the block above -->\n"
            "```\nready in 75 s: M (context 2048)\n\nParis.\n```\n")
    blocks, _ = parse(text, "p.md")
    shown = expected_outputs(blocks)["p.md:1"]
    assert shape_mismatch(shown, "log\nready in 3 s: M (context 2048)\n\n  Paris.\n") is None
    assert "Paris." in str(shape_mismatch(shown, "ready in 3 s: M (context 2048)\nRome.\n"))
    assert shape_mismatch(shown, "ready in soon: M (context 2048)\nParis.\n") is not None


def test_the_settings_file_of_the_configuration_reference_loads() -> None:
    """docs/configuration.md's YAML is marked as a settings file, not run: it loads here."""
    (block,) = [b for b in collect()[0] if b.path == "docs/configuration.md"
                and b.lang == "yaml"]
    assert yaml.safe_load(block.text)
    parse_config(block.text, "docs/configuration.md")
