"""Day one: every `fleet` sub-command's `--help` says what each argument is, and its default where it has one.

A new user reads `fleet <command> --help` before anything else. Each argument, positional or option, must
carry a description; an option that takes a value and has a default must say it (a unit goes in the text:
`(ms; default 2.0)`). The parser walked here is the one `fleet` runs (`producer.cli.build_parser`), and the
text checked is the one `--help` prints.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from producer.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[str, argparse.ArgumentParser]:
    """Every leaf sub-command's parser, by its words (``"models pin"``)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= _commands(sub, (*path, name))
    if not found and path:
        found[" ".join(path)] = parser
    return found


COMMANDS = _commands(build_parser())


def _gaps(parser: argparse.ArgumentParser) -> list[str]:
    """The arguments whose help says nothing, or does not give the default they have."""
    gaps = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        name = "/".join(action.option_strings) or action.dest
        if not action.help:
            gaps.append(f"{name}: no description")
            continue
        takes_value = action.nargs != 0
        default = action.default  # 0 is a default to say; a flag's False, None and an empty list are none
        has_default = not (default is None or default is argparse.SUPPRESS or isinstance(default, bool)
                           or default in ([], ""))
        if action.option_strings and takes_value and has_default and not action.required \
                and "default" not in action.help.lower():
            gaps.append(f"{name}: default {action.default!r} not said")
    return gaps


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_argument_is_described_with_its_default(command: str) -> None:
    assert _gaps(COMMANDS[command]) == []


def test_the_printed_help_shows_the_defaults() -> None:
    """What `fleet plan --help` prints (argparse fills ``%(default)s`` in): a user sees the number and its unit."""
    done = subprocess.run([sys.executable, "-m", "producer.cli", "plan", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for shown in ("(ms; default 2.0)", "(default 8)", "(hours; default 4.0)", "(ms; default 1000.0)"):
        assert shown in text, (shown, done.stdout)
