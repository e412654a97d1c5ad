"""`--help` of every pdserve command says what each flag defaults to."""

from __future__ import annotations

import argparse

import pytest

from services.cli import build_parser, main


def one_line(text: str) -> str:
    return " ".join(text.split())  # help wraps anywhere: compare without line breaks


def test_serve_help_shows_the_default_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    assert "(default: colocated)" in one_line(capsys.readouterr().out)


def parsers(
    parser: argparse.ArgumentParser,
    name: str = "pdserve",
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                found += parsers(child, f"{name} {sub}")
    return found


UNSET: tuple[object, ...] = (None, False, "", [], argparse.SUPPRESS)


def test_every_help_states_every_real_default() -> None:
    missing = []
    for name, parser in parsers(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.help in (None, argparse.SUPPRESS):
                continue
            if any(action.default is u or action.default == u for u in UNSET):
                continue  # "not given": the help says what happens then, if anything
            # the flag's help as `--help` prints it, with what the formatter adds
            shown = parser._get_formatter()._expand_help(action)
            if "default" not in shown:
                missing.append(f"{name} {action.option_strings[-1]}")
    assert missing == [], missing
