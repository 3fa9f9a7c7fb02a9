"""``broker.kombu_channel`` and the worker path's Redis commands: one client per channel and pool, no
``MULTI``/``EXEC`` per delivery, one store script per result (real redis-server and worker)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from kombu.transport import redis as kombu_redis

from broker import make_celery
from broker.kombu_channel import FleetChannel, PlainPipelineQoS
from protocol.celeryconf import celery_config
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet
from tests.integration.redis_monitor import Monitor
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis
from workers.drain_meter import FLUSH_INTERVAL_S


def test_a_channel_reuses_one_client_until_its_pool_changes(redis_server: EmbeddedRedis) -> None:
    app = make_celery(celery_config(load_settings(redis_url=redis_server.url)), "channel-test")
    assert kombu_redis.Transport.Channel is FleetChannel
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert isinstance(channel, FleetChannel) and isinstance(channel.qos, PlainPipelineQoS)
        first = channel._create_client()
        assert channel._create_client() is first
        assert first.ping()
        channel._pool = None  # what kombu does when it drops its pools on a reconnect
        again = channel._create_client()
        assert again is not first and again.ping()
        assert channel._create_client(asynchronous=True) is not again  # kombu's own, for BRPOP
    app.close()


def test_a_request_takes_no_transaction_and_one_store_script(fleet: Fleet) -> None:
    """Counted from Redis's MONITOR (commands a script runs included), by the key each command writes: the
    worker's heartbeats (a ``ZADD`` to its model's live set and direct-queue registry each beat) and the drain
    meter's flushes run on their own clock, so a window that takes longer holds more of them."""
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    for i in range(2):  # connections, the script and the routing state are set up here
        client.result(client.submit("demo-lm", [1, i + 2]), wait=True, timeout_s=60)
    monitor = Monitor(fleet.redis_url)
    try:
        started = time.monotonic()
        for i in range(10):
            assert client.result(client.submit("demo-lm", [3, i + 4]), wait=True, timeout_s=60) is not None
        # with acks_late the result is stored and published before the ack, and MONITOR relays each command a
        # moment after it ran: wait for the worker's tenth HDEL and the client's tenth UNSUBSCRIBE
        poll_until(lambda: len(_named(monitor.commands, "HDEL unacked ")) >= 10
                   and len(_named(monitor.commands, "UNSUBSCRIBE")) >= 10, 60, "the tenth ack and unsubscribe")
        elapsed_s = time.monotonic() - started
        commands = list(monitor.commands)
    finally:
        monitor.close()
    names = Counter(c["command"].split(" ", 1)[0].upper() for c in commands)
    assert names["MULTI"] == names["EXEC"] == 0, names  # plain pipelines and scripts
    assert names["BRPOP"] == names["RPOP"] == 0, names
    assert len(_named(commands, "LPUSH ")) == 10
    # the take script (broker.atomic_take: ZADD + HSET + LTRIM inside, run only when a list holds a message)
    # and one store script (the ack's HDEL inside) per request, beside the producer's own
    assert len(_named(commands, "ZADD unacked_index ")) == 10 and len(_named(commands, "HDEL unacked ")) == 10
    assert names["LTRIM"] == 10 and names["EVALSHA"] >= 20, names
    # the drain meter writes at most two seconds' counts per flush, not one per request
    assert names["INCRBY"] <= 2 * (int(elapsed_s / FLUSH_INTERVAL_S) + 2), (names["INCRBY"], elapsed_s)
    assert names["SUBSCRIBE"] == names["UNSUBSCRIBE"] == 10, names


def _named(commands: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [c for c in commands if c["command"].startswith(prefix)]


def test_flower_sees_each_result_as_its_repr(fleet: Fleet) -> None:
    """The task-succeeded event carries the result's text (workers.result_repr), as Flower shows it."""
    import base64
    import json

    import redis

    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    events = redis.Redis.from_url(fleet.redis_url).pubsub()
    events.psubscribe("*celeryev/task.*")  # task.succeeded, or task.multi when Celery sends them buffered
    confirmed = events.get_message(timeout=10)  # Redis's reply: from here on every event reaches us
    assert confirmed is not None and confirmed["type"] == "psubscribe", confirmed
    rid = client.submit("demo-lm", [5, 6, 7])
    result = client.result(rid, wait=True, timeout_s=60)
    assert result is not None
    stored = json.loads(redis.Redis.from_url(fleet.redis_url).get(f"celery-task-meta-{rid}") or b"{}")["result"]
    deadline = time.monotonic() + 10
    shown = None
    while shown is None and time.monotonic() < deadline:
        message = events.get_message(timeout=0.5)
        if message:
            body = json.loads(base64.b64decode(json.loads(message["data"])["body"]))
            for event in body if isinstance(body, list) else [body]:
                if event.get("type") == "task-succeeded" and event.get("uuid") == rid:
                    shown = event["result"]
    assert shown == repr(stored)
