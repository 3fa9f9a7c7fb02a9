"""``workers.worker_runtime.shutting_down``: read Celery's shutdown flags as Celery does (an exit code of 0 counts)."""

from __future__ import annotations

import pytest
from celery.worker import state as worker_state

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
