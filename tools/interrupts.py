"""Ctrl-C that CPython would drop or misreport: the repairs every ``fleet`` command runs under.

A signal handler (Python's own for SIGINT, or :func:`tools.processes.interrupt_on_stop_signals`) raises
KeyboardInterrupt between two bytecodes of whatever the main thread runs. Two places turn that into a lie:

* **A finalizer.** Raised inside a ``__del__``, a weakref callback or an atexit function, the exception
  cannot propagate: Python prints ``Exception ignored in …`` with a traceback and drops it, so the user
  sees a traceback and the command runs on. :func:`note_lost_interrupts` notes it instead of printing it;
  a command's waiting loops stop on the note (:func:`tools.processes.stop_requested`) and
  :func:`producer.cli_errors.run_command` ends a command that ran to its end as interrupted. (It cannot
  be raised again in the main thread from there: a re-raised signal runs its handler at the next bytecode
  of the hook itself, which is still a finalizer's context.)
* **Code run from a string.** CPython (3.11, 3.12) notes a KeyboardInterrupt that leaves an ``exec`` or
  ``eval`` of a string (``dataclasses`` builds every generated method that way, so any import can be one)
  as unhandled, even when a caller catches it later; under ``python -m`` the interpreter then kills
  itself with SIGINT at exit (status -2; a shell shows 130) whatever ``sys.exit`` was given.
  :func:`forget_caught_interrupt` clears that note once the command has dealt with the interrupt.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["forget_caught_interrupt", "forget_lost_interrupts", "interrupt_was_lost", "note_lost_interrupts"]

_LOST: list[bool] = []
"""Non-empty once a finalizer swallowed a KeyboardInterrupt: a flag set by ``append`` in the hook, so no lock
is taken that the thread a finalizer interrupted may already hold."""

_MARK = "_fleet_notes_lost_interrupts"
"""Attribute set on the installed hook, so a second install does not wrap it again."""


def note_lost_interrupts() -> None:
    """Note a KeyboardInterrupt raised inside a finalizer instead of printing its traceback (idempotent).

    Wraps :data:`sys.unraisablehook`: an unraisable KeyboardInterrupt is recorded
    (:func:`interrupt_was_lost`); every other unraisable exception goes to the previous hook unchanged.
    """
    if getattr(sys.unraisablehook, _MARK, False):
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _LOST.append(True)
            return
        previous(unraisable)

    setattr(hook, _MARK, True)
    sys.unraisablehook = hook


def interrupt_was_lost() -> bool:
    """Whether a finalizer swallowed a KeyboardInterrupt since :func:`forget_lost_interrupts`."""
    return bool(_LOST)


def forget_lost_interrupts() -> None:
    """Start a fresh record (a new command, a new set of stop handlers)."""
    _LOST.clear()


def forget_caught_interrupt() -> None:
    """Clear CPython's note of a KeyboardInterrupt that left a string ``exec``/``eval`` (module docstring).

    Every string exec resets the note when it starts; an empty one leaves it clear. Call it once the
    interrupt has been handled (the command prints ``fleet: interrupted`` and returns 130): the exit status
    is then the command's. A KeyboardInterrupt still propagating when the process ends is noted again by
    CPython itself, so nothing real is hidden.
    """
    exec("pass", {})  # a constant: the string exec is the point
