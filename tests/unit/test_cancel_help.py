"""``fleet --help`` says what ``fleet cancel`` does: a queued request is never run, and a running
generation stops within a decode step (README, Generation; ``DELETE /v1/requests/{id}``). The help
said "cancel a request that has not run", which sends a user with a running generation elsewhere."""

from __future__ import annotations

import argparse

from producer.cli import build_parser


def test_the_cancel_help_names_running_generations() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in sub._choices_actions}
    assert "running generation" in helps["cancel"]
    assert "has not run" not in helps["cancel"]
