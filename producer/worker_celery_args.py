"""What ``fleet worker`` passes on to ``celery worker``: every option it does not read itself, in the order given
(``fleet worker --model demo-lm --logfile w.log -O fair``), and after a ``--`` everything (the ``--`` itself is
``fleet``'s and stays here: Celery takes no positional argument and refused it).

Options by which the fleet runs the worker are refused, each naming the setting to use instead: the pool (the
fleet's threads pool is its token bucket), the queues (the model's queue), autoscaling and a second concurrency
(the bucket holds ``worker.concurrency`` tokens, fixed).

:class:`PassThroughParser` is the ``fleet`` parsers' class: a sub-command parser that sets ``passes_unknown_to``
keeps the options it does not know in that attribute of the namespace instead of refusing them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from protocol.errors import ConfigError

__all__ = ["FLEET_SETS", "PassThroughParser", "celery_args"]

_POOL = "the fleet runs Celery's threads pool, whose threads are the token bucket; size it with --concurrency N " \
        "(worker.concurrency)"
_QUEUES = "the worker takes its model's queue; choose the model with --model (worker.model) and its queue with " \
          "models.<name>.queue"
_CONCURRENCY = "give it to fleet worker, before any --: --concurrency N (worker.concurrency)"
_AUTOSCALE = "the token bucket is fixed: size it with --concurrency N (worker.concurrency) and run more workers"

FLEET_SETS: dict[str, str] = {
    "-P": _POOL, "--pool": _POOL,
    "-Q": _QUEUES, "--queues": _QUEUES, "-X": _QUEUES, "--exclude-queues": _QUEUES,
    "-c": _CONCURRENCY, "--concurrency": _CONCURRENCY,
    "--autoscale": _AUTOSCALE,
}  # fmt: skip
"""Celery worker options the fleet sets itself (:func:`tools.processes.worker_command`) -> what to use instead."""


def celery_args(extras: Sequence[str]) -> list[str]:
    """The arguments for ``celery worker``: ``extras`` (what ``fleet worker`` did not read) without its first
    ``--``.

    Raises:
        ConfigError: an option in :data:`FLEET_SETS` (``-P solo``, ``--pool=solo``, ``-Psolo``); the message
            names it and the fleet setting to use instead (exit 2, nothing started).
    """
    args = list(extras)
    if "--" in args:
        args.remove("--")  # the first one: fleet's end of options
    for arg in args:
        if (option := _fleet_set(arg)) is not None:
            raise ConfigError(f"fleet worker does not pass {option} to celery: {FLEET_SETS[option]}",
                              option, "an option the fleet does not set")
    return args


def _fleet_set(arg: str) -> str | None:
    """The :data:`FLEET_SETS` option ``arg`` gives (alone, ``--pool=solo`` or ``-Psolo``), else None."""
    if arg.startswith("--"):
        name = arg.partition("=")[0]
        return name if name in FLEET_SETS else None
    if arg.startswith("-") and len(arg) >= 2 and arg[:2] in FLEET_SETS:
        return arg[:2]
    return None


class PassThroughParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose instance may set :attr:`passes_unknown_to`: the namespace attribute that then
    receives the arguments it does not know, in order (``fleet worker``'s Celery options), instead of argparse's
    "unrecognized arguments". Sub-parsers made from it are of its class; only one that sets it passes anything."""

    passes_unknown_to: str | None = None

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """``ArgumentParser.parse_known_args``; with :attr:`passes_unknown_to` set, no argument is left over."""
        parsed, extras = super().parse_known_args(args, namespace)
        if self.passes_unknown_to is None:
            return parsed, extras
        setattr(parsed, self.passes_unknown_to, extras)
        return parsed, []
