"""``python -m tests.integration.interrupted_cli WHERE``: the real ``fleet`` entry point (``producer.cli.main``)
running one extra command that takes a Ctrl-C where CPython mishandles it.

WHERE is ``string-exec`` (the KeyboardInterrupt leaves an ``exec`` of a string, as inside any dataclass
definition) or ``finalizer`` (the SIGINT's handler runs inside a ``__del__``, where Python can only drop
the exception, so the command runs to its end). Run it under ``python -m``: that is the path on which
CPython's string-exec note decides the exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import producer.cli

COMMAND = "take-ctrl-c"


def _in_string_exec(_args: argparse.Namespace) -> None:
    exec("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nfor _ in range(1000): pass", {})


class FinalizerTakesCtrlC:
    """An object whose ``__del__`` receives a SIGINT: its handler runs there, where Python drops the exception."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs at the loop's first backward jump, inside __del__
            pass


def _in_finalizer(_args: argparse.Namespace) -> None:
    FinalizerTakesCtrlC()  # collected at once: its __del__ takes the Ctrl-C, and the command runs to its end


COMMANDS = {"string-exec": _in_string_exec, "finalizer": _in_finalizer}


def _with_command(build: Any, func: Any) -> Any:
    def build_parser() -> argparse.ArgumentParser:
        parser = build()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.add_parser(COMMAND).set_defaults(func=func)
        return parser

    return build_parser


if __name__ == "__main__":
    # Python's own SIGINT handler, as under a terminal (a test run started in the background, by a
    # non-interactive shell, passes SIGINT on ignored, and then Python installs none)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    producer.cli.build_parser = _with_command(producer.cli.build_parser, COMMANDS[sys.argv[1]])
    raise SystemExit(producer.cli.main([COMMAND]))
