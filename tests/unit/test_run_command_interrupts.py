"""``run_command`` ends a command whose Ctrl-C a finalizer swallowed as interrupted, once: the record is that
command's, and the next command in the same process ends with its own code (:mod:`tools.interrupts`)."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Iterator

import pytest

from producer.cli_errors import EXIT_INTERRUPTED, run_command
from tests.integration.interrupted_cli import FinalizerTakesCtrlC


@pytest.fixture(autouse=True)
def _python_sigint_handler() -> Iterator[None]:
    saved = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what an interactive `fleet` runs under
    yield
    signal.signal(signal.SIGINT, saved)


def _ctrl_c_in_a_finalizer(_args: argparse.Namespace) -> int:
    FinalizerTakesCtrlC()
    return 0  # runs on: the KeyboardInterrupt was dropped where it was raised


def test_a_ctrl_c_swallowed_by_a_finalizer_ends_that_command_only(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(debug=False)
    assert run_command(_ctrl_c_in_a_finalizer, args) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "fleet: interrupted\n"
    assert run_command(lambda _args: 0, args) == 0
    assert capsys.readouterr().err == ""
