"""OutageLog: one warning per outage, repeats at DEBUG, one INFO line when Redis answers again (pure, no I/O)."""

from __future__ import annotations

import logging

import pytest

from workers.redis_outage import OutageLog

# (event, time s) → the (level, text fragment) it logs, or None
STEPS: list[tuple[str, float, tuple[int, str] | None]] = [
    ("ok", 0.0, None),  # no outage: a success says nothing
    ("fail", 1.0, (logging.WARNING, "loop lost Redis: refused; retrying (further failures are logged at DEBUG")),
    ("fail", 2.0, (logging.DEBUG, "failure 2 of this outage")),
    ("fail", 3.0, (logging.DEBUG, "failure 3 of this outage")),
    ("ok", 4.5, (logging.INFO, "loop lost Redis: Redis answers again after 3.5 s (3 failed tries)")),
    ("ok", 5.0, None),
    ("fail", 6.0, (logging.WARNING, "loop lost Redis: refused; retrying")),  # a new outage warns again
    ("ok", 6.0, (logging.INFO, "after 0.0 s (1 failed tries)")),
]


def test_one_warning_per_outage_and_one_line_when_redis_is_back(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.outage")
    outage = OutageLog(logger, "loop lost Redis")
    caplog.set_level(logging.DEBUG, logger="test.outage")
    for event, now_s, expected in STEPS:
        caplog.clear()
        if event == "fail":
            outage.failed(ConnectionError("refused"), now_s)
            assert outage.down
        else:
            outage.recovered(now_s)
            assert not outage.down
        records = [(r.levelno, r.getMessage()) for r in caplog.records]
        if expected is None:
            assert records == [], (event, now_s)
        else:
            assert len(records) == 1 and records[0][0] == expected[0] and expected[1] in records[0][1], records
