"""``workers.worker_runtime.shutting_down``: read Celery's shutdown flags as Celery does (an exit code of 0 counts)."""

from __future__ import annotations

import pytest
from celery.worker import state as worker_state

from workers.health import next_beat_in_s
from workers.worker_runtime import shutting_down


@pytest.mark.parametrize(
    ("should_stop", "should_terminate", "expected"),
    [
        (None, None, False),
        (False, None, False),
        (0, None, True),  # a warm shutdown's exit code EX_OK: set, though falsy
        (1, None, True),
        (None, 0, True),
        (None, True, True),
        (None, False, False),
    ],
)
def test_shutting_down_follows_celerys_flags(monkeypatch: pytest.MonkeyPatch, should_stop: object,
                                             should_terminate: object, expected: bool) -> None:
    monkeypatch.setattr(worker_state, "should_stop", should_stop)
    monkeypatch.setattr(worker_state, "should_terminate", should_terminate)
    assert shutting_down() is expected


@pytest.mark.parametrize(("took_s", "wait_s"), [(0.0, 2.0), (0.5, 1.5), (1.7, 0.3), (1.9, 0.2), (7.0, 0.2)])
def test_beats_start_every_period_whatever_the_last_one_took(took_s: float, wait_s: float) -> None:
    """A beat and its hooks that took ``took_s`` of a 2 s period leave the rest of it (before: a whole period
    more, so the beats drifted apart by every round trip on a slow link), and never less than a tenth of it."""
    assert next_beat_in_s(100.0, 100.0 + took_s, 2.0) == pytest.approx(wait_s)
