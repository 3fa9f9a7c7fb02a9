"""Queue depth is requests waiting: a ``fleet.infer_bulk`` message counts as the requests it carries
(:mod:`broker.queue_weight`), in ``fleet status``, the gateway's ``fleet_queue_depth`` and admission.

Old behaviour: every reader took ``LLEN``, so 3 bulk messages of 100 requests read as a depth of 3, and a
bulk sender passed ``models.<name>.max_queue_depth`` (a cap of 350 admitted a 4th and a 5th message of 100).
Real redis-server, real producer (``FleetClient.submit_bulk``), the real CLI, gateway and Celery worker, and
kombu's own take and restore (what a worker that dies holding a message gets: its unacked message put back).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker import queue_depth
from producer.client import FleetClient
from protocol.errors import QueueFull
from tests.integration.ops_fixtures import OpsFleet, ops_fleet, ops_models, ops_redis, scrape, wait_until  # noqa: F401

pytestmark = pytest.mark.timeout(240)

CAP = 350
"""``models.demo-lm.max_queue_depth`` in these tests (requests)."""


def _config(ops: OpsFleet) -> Path:
    return ops.config(models={"demo-lm": {"max_queue_depth": CAP}},
                      admission={"queue_depth_cache_ms": 0})  # each admission reads Redis: no window to reason on


def _status(ops: OpsFleet, config: Path) -> dict[str, int]:
    """``fleet status --json``'s queue row of demo-lm."""
    done = ops.fleet_cli(config, "status", "--json", module="producer.ops_cli")
    assert done.returncode in (0, 1), done.stderr[-2000:]  # 1: no ready worker, the document is printed all the same
    rows = {q["model"]: q for q in json.loads(done.stdout)["queues"]}
    return dict(rows["demo-lm"])


def test_three_bulk_messages_of_100_are_300_waiting(ops_fleet: OpsFleet) -> None:  # noqa: F811
    config = _config(ops_fleet)
    client = FleetClient.from_settings(config)
    try:
        ids = client.submit_bulk("demo-lm", [[5, 6, i % 50 + 1] for i in range(300)], chunk_size=100)
        queue = client.settings.queue_for("demo-lm")
        assert queue_depth(client.redis, queue) == 3  # three messages on the lists
        assert _status(ops_fleet, config)["depth"] == 300  # was 3
        gateway = ops_fleet.gateway(config)
        metric = scrape(gateway.url + "/metrics")[("fleet_queue_depth", (("model", "demo-lm"),))]
        assert metric == 300  # was 3

        # the bound: 300 wait, a bulk of 100 more would make 400 > 350: refused whole, naming the limit
        with pytest.raises(QueueFull) as refused:
            client.submit_bulk("demo-lm", [[7, 8]] * 100, chunk_size=100, request_ids=[f"over-{i}" for i in range(100)])
        text = str(refused.value)
        assert "hold 300 requests" in text and f"models.demo-lm.max_queue_depth={CAP}" in text, text
        assert refused.value.field == "max_queue_depth" and refused.value.limit == CAP
        assert queue_depth(client.redis, queue) == 3  # nothing of it was queued
        client.submit_bulk("demo-lm", [[7, 9]] * 50, chunk_size=50, request_ids=[f"fits-{i}" for i in range(50)])
        assert _status(ops_fleet, config)["depth"] == CAP
        with pytest.raises(QueueFull):  # a single request over the cap is refused as well
            client.submit("demo-lm", [5, 6])

        # a real worker takes the bulk messages: the depth falls to 0, and every request has its result
        ops_fleet.worker(config)
        for rid in ids:
            assert client.result(rid, wait=True, timeout_s=120) is not None
        wait_until(lambda: _status(ops_fleet, config)["depth"] == 0, 120, "the queue drained")
        assert scrape(gateway.url + "/metrics")[("fleet_queue_depth", (("model", "demo-lm"),))] == 0
    finally:
        client.close()


def test_a_request_text_cannot_forge_a_bulk_count(ops_fleet: OpsFleet) -> None:  # noqa: F811
    """A single request whose text (shown in its ``argsrepr``) holds the bulk pattern counts as one request."""
    config = _config(ops_fleet)
    client = FleetClient.from_settings(config)
    try:
        client.submit_bulk("demo-lm", [[5, 6]] * 10, chunk_size=10)  # the queue is marked: its messages are read
        client.submit("demo-lm", text='"argsrepr": "[{\\"bulk_requests\\": 4000, x', top_k=1)
        assert _status(ops_fleet, config)["depth"] == 11
    finally:
        client.close()


def test_a_bulk_message_taken_then_restored_counts_again(ops_fleet: OpsFleet) -> None:  # noqa: F811
    """Redelivery: a consumer takes a bulk message (kombu records it unacked) and goes away without acking it;
    kombu restores it to the queue. The depth follows the lists: 200 while it is held, 300 once it is back."""
    config = _config(ops_fleet)
    client = FleetClient.from_settings(config)
    try:
        client.submit_bulk("demo-lm", [[5, 6, i % 50 + 1] for i in range(300)], chunk_size=100)
        queue = client.settings.queue_for("demo-lm")
        with client.app.connection_for_read() as conn:
            taken = conn.SimpleQueue(queue)
            message = taken.get(timeout=30)
            assert message is not None and message.headers["task"] == "fleet.infer_bulk"
            assert _status(ops_fleet, config)["depth"] == 200
            taken.close()  # no ack: kombu's channel restores what it held (restore_unacked_once)
        wait_until(lambda: queue_depth(client.redis, queue) == 3, 30, "the message restored")
        assert _status(ops_fleet, config)["depth"] == 300
    finally:
        client.close()
