"""A foreground server command (``fleet redis``, ``fleet store``) stops cleanly whenever its stop signal
comes after its ready line is being written: a caller that reads the line and at once sends SIGINT hit
the moment between the line and the wait, and the command died with exit 130 and no stop."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tools.processes import serve_until_stopped


@pytest.fixture(autouse=True)
def _handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_ready_line_is_written_still_stops_once(sig: signal.Signals) -> None:
    stops, waited = [], []

    def ready() -> None:
        print("listening (Ctrl-C stops it)", flush=True)
        os.kill(os.getpid(), sig)  # the caller read the line and signalled at once
        waited.append("never reached")  # the handler raises at the next bytecode boundary

    serve_until_stopped(ready, lambda: waited.append("waited"), lambda: stops.append(1))
    assert stops == [1] and waited == []


def test_a_signal_during_stop_is_ignored() -> None:
    stops = []

    def stop() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while stopping
        stops.append(1)

    serve_until_stopped(lambda: None, lambda: os.kill(os.getpid(), signal.SIGTERM), stop)
    assert stops == [1]
