"""Day one: a worker started before its Redis says so once per loop, not three times a second.

`fleet worker` before `fleet redis` (or a Redis restart under a live worker): the heartbeat, the reconciler and
the cancel listener each retry about once a second. Before, each failed try logged a warning (about 30 lines in
10 s, the same three texts), burying the line that says what to do. Now each loop warns once per outage, logs
its repeats at DEBUG, and says once when Redis answers again, with the outage's length and failed tries.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.fleet_fixtures import Fleet
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis

CONSUMER_RETRIES = 3  # Celery's consumer retries after 2, 4, 6 s: by its third the 1 s loops failed several times
LOOPS = {"reconciler": "fleet.reconcile] reconciler lost Redis", "cancel listener": "fleet.streams] cancel listener"}


def _log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.timeout(240)
def test_a_worker_started_before_redis_warns_once_per_loop_and_says_when_redis_is_back(
    fleet: Fleet, redis_server: EmbeddedRedis
) -> None:
    cfg = fleet.config()
    redis_server.kill()  # nothing answers at the worker's URL
    worker = fleet.worker(cfg, wait=False)
    assert worker.log_path is not None
    log_path = worker.log_path

    poll_until(lambda: _log(log_path).count("Trying again in") >= CONSUMER_RETRIES, 120,
               what=f"{CONSUMER_RETRIES} retries of the Celery consumer")
    text = _log(log_path)
    for loop, tail in LOOPS.items():
        warnings = [line for line in text.splitlines() if "WARNING/" + tail in line]
        assert len(warnings) == 1, f"{loop}: {len(warnings)} warnings during one outage:\n" + "\n".join(warnings[:8])

    redis_server.start()  # same port, empty
    worker.wait_ready(120)

    def recovered() -> dict[str, int] | None:
        found = {loop: re.search(re.escape(tail) + r"[^\n]*Redis answers again after [\d.]+ s \((\d+) failed tries\)",
                                 _log(log_path)) for loop, tail in LOOPS.items()}
        return {loop: int(m.group(1)) for loop, m in found.items() if m} if all(found.values()) else None

    tries = poll_until(recovered, 60, what="each loop's 'Redis answers again' line")
    assert all(n >= 2 for n in tries.values()), tries  # the loops did retry: their repeats went to DEBUG
