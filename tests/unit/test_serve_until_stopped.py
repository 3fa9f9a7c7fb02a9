"""A foreground server command (``fleet redis``, ``fleet store``) stops cleanly whenever its stop signal
comes after its ready line is being written: a caller that reads the line and at once sends SIGINT hit
the moment between the line and the wait, and the command died with exit 130 and no stop."""

from __future__ import annotations

import gc
import os
import signal
import sys
import weakref
from collections.abc import Iterator

import pytest

from tools.interrupts import forget_lost_interrupts, interrupt_was_lost
from tools.processes import interrupt_on_stop_signals, serve_until_stopped, stop_requested


@pytest.fixture(autouse=True)
def _handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    forget_lost_interrupts()  # a later test's command must not end as interrupted


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_ready_line_is_written_still_stops_once(sig: signal.Signals) -> None:
    stops, waited = [], []

    def ready() -> None:
        print("listening (Ctrl-C stops it)", flush=True)
        os.kill(os.getpid(), sig)  # the caller read the line and signalled at once
        waited.append("never reached")  # the handler raises at the next bytecode boundary

    def running() -> bool:
        waited.append("waited")
        return True

    serve_until_stopped(ready, running, lambda: stops.append(1))
    assert stops == [1] and waited == []


def test_a_signal_during_stop_is_ignored() -> None:
    stops = []

    def stop() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while stopping
        stops.append(1)

    def running() -> bool:
        os.kill(os.getpid(), signal.SIGTERM)
        return True

    serve_until_stopped(lambda: None, running, stop)
    assert stops == [1]


def _signal_inside_a_finalizer(sig: signal.Signals) -> None:
    """Send ``sig`` to this process from a weakref callback: the handler runs there, and Python drops the
    KeyboardInterrupt it raises ("Exception ignored in …")."""

    class Held:
        pass

    def finalizer(_ref: object) -> None:
        os.kill(os.getpid(), sig)
        for _ in range(1000):  # the handler runs at the loop's first backward jump, inside the callback
            pass

    held = Held()
    ref = weakref.ref(held, finalizer)
    try:
        del held
        gc.collect()
    except KeyboardInterrupt:  # the handler ran outside the callback: this test proves nothing then
        pytest.fail("the stop signal's handler did not run inside the finalizer")
    assert ref() is None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_dropped_in_a_finalizer_is_still_noted_and_not_printed(
    sig: signal.Signals, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python hands the dropped KeyboardInterrupt to ``sys.unraisablehook``, whose default prints "Exception
    ignored in …" and its traceback on the command's stderr; other unraisable exceptions still reach it."""
    printed: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: printed.append(unraisable.exc_value))
    interrupt_on_stop_signals()
    _signal_inside_a_finalizer(sig)  # no KeyboardInterrupt reaches this frame
    assert stop_requested() and interrupt_was_lost() and printed == []

    class Failing:
        def __del__(self) -> None:
            raise ValueError("a finalizer's own failure")

    Failing()
    assert [type(exc) for exc in printed] == [ValueError]


def test_a_server_stops_even_when_its_stop_signal_was_dropped_in_a_finalizer() -> None:
    """The server runs on (``running()`` stays True); the KeyboardInterrupt was lost, the note was not."""
    stops, checks = [], []

    def running() -> bool:
        checks.append(1)
        if len(checks) == 1:
            _signal_inside_a_finalizer(signal.SIGTERM)
        assert len(checks) < 10_000, "the stop request was never seen"
        return True

    serve_until_stopped(lambda: None, running, lambda: stops.append(1))
    assert stops == [1] and len(checks) == 1
    assert not interrupt_was_lost(), "the stop was handled: `fleet redis` ends with 0, as on any Ctrl-C"
