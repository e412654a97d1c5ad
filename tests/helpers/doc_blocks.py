"""The fenced code blocks of README.md and docs/*.md, and how the docs test treats each.

A ```bash or ```python block runs as written. Any other block, or one that cannot run here,
carries a marker: an HTML comment (invisible on the rendered page) right before its fence.

    <!-- not-run: REASON -->
        never run; REASON says why: `output` (sample output, diagrams, excerpts), a
        long-running command the test's stack stands in for, or what this machine lacks
    <!-- run-with: `OLD` -> `NEW`: REASON -->
        run with OLD replaced by NEW (say why: a shorter run of the same command)

`problems` lists every block that is neither runnable nor marked, and every malformed or
stray marker, each by file and line.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = ("bash", "python")
_MARKER = re.compile(r"<!--\s*(not-run|run-with):(.*?)-->", re.DOTALL)
_RUN_WITH = re.compile(r"\s*`([^`]+)`\s*->\s*`([^`]*)`\s*:\s*(\S.*)", re.DOTALL)


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based, the opening fence
    lang: str  # the fence's info string ("" for none)
    text: str
    marker: str = ""  # "not-run", "run-with" or ""
    reason: str = ""  # what the marker says after its kind

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUNNABLE and self.marker != "not-run"

    @property
    def script(self) -> str:
        """The text the test runs: with a run-with marker's substitution made."""
        if self.marker != "run-with":
            return self.text
        match = _RUN_WITH.match(self.reason)
        assert match, self.where
        return self.text.replace(match[1], match[2])


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def parse(text: str, path: str) -> tuple[list[Block], list[str]]:
    """The code blocks of one Markdown text, and the problems of its markers."""
    tokens = MarkdownIt("commonmark").parse(text)
    blocks: list[Block] = []
    problems: list[str] = []
    for i, token in enumerate(tokens):
        if token.type not in ("fence", "code_block") or token.map is None:
            continue
        kind, reason = _marker_before(tokens, i)
        blocks.append(Block(path, token.map[0] + 1, token.info.strip().split(" ")[0],
                            token.content, kind, reason))
    for i, token in enumerate(tokens):  # a marker must sit right before a block
        if token.type == "html_block" and _MARKER.search(token.content) and token.map:
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            if nxt is None or nxt.type not in ("fence", "code_block") or \
                    nxt.map is None or nxt.map[0] != token.map[1]:
                problems.append(f"{path}:{token.map[0] + 1}: a marker not on the line right "
                                "before a code block's fence")
    return blocks, problems


def _marker_before(tokens: list[Token], i: int) -> tuple[str, str]:
    prev = tokens[i - 1] if i else None
    if prev is None or prev.type != "html_block" or prev.map is None or \
            prev.map[1] != tokens[i].map[0]:  # type: ignore[index]
        return "", ""
    match = _MARKER.search(prev.content)
    return (match[1], " ".join(match[2].split())) if match else ("", "")


def collect(root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """Every code block of README.md and docs/*.md, and the marker problems."""
    blocks: list[Block] = []
    problems: list[str] = []
    for file in doc_files(root):
        found, wrong = parse(file.read_text(), str(file.relative_to(root)))
        blocks += found
        problems += wrong
    return blocks, problems


def problems(blocks: list[Block]) -> list[str]:
    """Each block that is neither runnable nor marked, or whose marker is malformed."""
    out: list[str] = []
    for b in blocks:
        fence = f"a ```{b.lang} block" if b.lang else "a block with no language"
        if b.marker == "" and b.lang not in RUNNABLE:
            out.append(f"{b.where}: {fence} the docs test cannot run: mark it "
                       "`<!-- not-run: REASON -->` (REASON `output` for sample output)")
        elif b.marker == "not-run" and not b.reason:
            out.append(f"{b.where}: `not-run` without a reason")
        elif b.marker == "run-with":
            match = _RUN_WITH.match(b.reason)
            if b.lang not in RUNNABLE:
                out.append(f"{b.where}: `run-with` on {fence}, which cannot run")
            elif match is None:
                out.append(f"{b.where}: `run-with` wants `OLD` -> `NEW`: REASON")
            elif match[1] not in b.text:
                out.append(f"{b.where}: `run-with`: `{match[1]}` is not in the block")
    return out


def expected_outputs(blocks: list[Block]) -> dict[str, str]:
    """The output shown for a block (the next block, marked `output of the block above`),
    by the block's place."""
    return {before.where: after.text for before, after in itertools.pairwise(blocks)
            if after.path == before.path and after.reason.startswith("output of the block above")}


def shape_mismatch(shown: str, actual: str) -> str | None:
    """None when every line shown appears in `actual`, in order, numbers aside; else what
    is missing."""
    lines = [line.strip() for line in actual.splitlines()]
    at = 0
    for want in (w.strip() for w in shown.splitlines() if w.strip()):
        pattern = re.compile(re.sub(r"\d+", r"\\d+", re.escape(want)))
        while at < len(lines) and not pattern.fullmatch(lines[at]):
            at += 1
        if at == len(lines):
            return f"the output shown has {want!r}; the block printed no such line after the last"
        at += 1
    return None
