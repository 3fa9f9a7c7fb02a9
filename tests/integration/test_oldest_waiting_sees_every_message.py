"""``fleet status``'s OLDEST WAITING is the age of the oldest request waiting, whatever message carries it.

Before, it read the ``submitted_at_unix_s`` of the message at the tail of the queue's own list only: a
``fleet.infer_bulk`` message there (its requests carry the time, the message does not) read ``-`` with DEPTH > 0,
and a message a plain Celery client sent with a priority (kombu keeps it in a sibling list) was never looked at.
Real redis-server, no worker (so everything waits), the real ``fleet status --json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery

from tests.integration.fleet_fixtures import Fleet

MODEL = "demo-lm"
ROOT = Path(__file__).resolve().parents[2]


def _queue_row(config: Path) -> tuple[dict[str, Any], float, float]:
    """demo-lm's row of ``fleet status --json``, and the wall clock just before and after the command."""
    before = time.time()
    out = subprocess.run([sys.executable, "-m", "producer.ops_cli", "status", "--json", "--config", str(config)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    after = time.time()
    row = next(q for q in json.loads(out.stdout)["queues"] if q["model"] == MODEL)
    return row, before, after


def test_a_bulk_message_at_the_head_of_the_queue_has_an_age(fleet: Fleet) -> None:
    config = fleet.config()
    client = fleet.client(config)
    sent_from = time.time()
    client.submit_bulk(MODEL, [[1, 2], [3, 4, 5]])
    sent_by = time.time()
    client.submit(MODEL, [5, 6])
    row, before, after = _queue_row(config)
    assert row["depth"] == 3  # requests waiting: the bulk message's two and the lone one
    assert row["oldest_waiting_s"] is not None, row
    # the bulk message's requests were stamped between sent_from and sent_by; status read the clock in [before, after]
    assert before - sent_by - 0.001 <= row["oldest_waiting_s"] <= after - sent_from + 0.001, row


def test_a_prioritized_message_counts_for_the_oldest_age(fleet: Fleet) -> None:
    config = fleet.config()
    client = fleet.client(config)
    client.submit(MODEL, [5, 6])  # the queue's own list: younger than the prioritized one below
    stamped = time.time() - 600.0  # a request its client stamped ten minutes ago, still waiting
    app = Celery("plain", broker=fleet.redis_url)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=False)
    try:
        app.send_task("fleet.infer", args=[{"model": MODEL, "input_ids": [5, 6, 7], "submitted_at_unix_s": stamped}],
                      queue=fleet.settings(config).queue_for(MODEL), priority=9)  # fmt: skip
    finally:
        app.close()
    row, before, after = _queue_row(config)
    assert row["depth"] == 2
    assert row["oldest_waiting_s"] is not None, row
    assert before - stamped - 0.001 <= row["oldest_waiting_s"] <= after - stamped + 0.001, row
