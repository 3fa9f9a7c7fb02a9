"""``broker.event_buffer``: a worker's task events gathered into ``task.multi`` messages, published
off the requests' path; none lost at a restart of the consumer or a warm shutdown (real redis-server,
real Celery dispatcher, real workers)."""

from __future__ import annotations

import base64
import json
import time
from collections import defaultdict
from typing import Any

import redis

from broker import make_celery
from broker.event_buffer import EventFlusher
from protocol.celeryconf import celery_config
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet
from tools.redis_server import EmbeddedRedis

TASK_EVENTS = ("task-received", "task-started", "task-succeeded")


class EventTap:
    """Every task event published on ``redis_url``, with the routing key of the message that carried it."""

    def __init__(self, redis_url: str) -> None:
        self.pubsub = redis.Redis.from_url(redis_url).pubsub()
        self.pubsub.psubscribe("*celeryev/task.*")
        confirmed = self.pubsub.get_message(timeout=10)  # Redis's reply: from here on every event reaches us
        assert confirmed is not None and confirmed["type"] == "psubscribe", confirmed
        self.messages: list[tuple[str, list[dict[str, Any]]]] = []

    def read(self, until: Any, timeout_s: float = 20.0) -> None:
        """Read messages until ``until(self)`` holds or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not until(self) and time.monotonic() < deadline:
            message = self.pubsub.get_message(timeout=0.2)
            if message:
                routing_key = message["channel"].decode().rsplit("/", 1)[-1]
                body = json.loads(base64.b64decode(json.loads(message["data"])["body"]))
                self.messages.append((routing_key, body if isinstance(body, list) else [body]))

    def by_task(self) -> dict[str, list[dict[str, Any]]]:
        events: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for _, body in self.messages:
            for event in body:
                if event.get("type") in TASK_EVENTS:
                    events[event["uuid"]].append(event)
        return events

    def has_all(self, ids: list[str]) -> bool:
        seen = self.by_task()
        return all(sorted(e["type"] for e in seen.get(rid, [])) == sorted(TASK_EVENTS) for rid in ids)


def test_a_worker_s_task_events_come_gathered_and_complete(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    tap = EventTap(fleet.redis_url)
    ids = client.submit_many("demo-lm", [[3, i + 4] for i in range(16)])
    assert all(r is not None for r in client.wait(ids, 60))
    tap.read(lambda t: t.has_all(ids))
    assert tap.has_all(ids), {rid: [e["type"] for e in tap.by_task().get(rid, [])] for rid in ids}
    worker_messages = [(key, body) for key, body in tap.messages if any(e["type"] in TASK_EVENTS for e in body)]
    events = sum(len(body) for _, body in worker_messages)
    assert {key for key, _ in worker_messages} == {"task.multi"}
    # 48 events gathered for 20 ms at a time (Celery's own loop published 2-3 per message here)
    assert len(worker_messages) <= events / 4, [len(body) for _, body in worker_messages]
    for rid, seen in tap.by_task().items():  # each keeps the time it happened, in order
        when = {e["type"]: e["timestamp"] for e in seen}
        assert when["task-received"] <= when["task-started"] <= when["task-succeeded"], rid


def test_linger_zero_leaves_celery_s_own_publishing_and_loses_nothing(fleet: Fleet) -> None:
    """0 = Celery's behaviour: its event loop publishes the buffer each turn, on the consumer's thread."""
    cfg = fleet.config(celery={"task_event_linger_ms": 0})
    fleet.worker(cfg)
    client = fleet.client(cfg)
    tap = EventTap(fleet.redis_url)
    ids = [client.submit("demo-lm", [5, i + 6]) for i in range(3)]
    assert all(r is not None for r in client.wait(ids, 60))
    tap.read(lambda t: t.has_all(ids))
    assert tap.has_all(ids)


def _dispatcher(redis_url: str) -> Any:
    app = make_celery(celery_config(load_settings(redis_url=redis_url)), "event-buffer-test")
    return app, app.events.Dispatcher(app.connection_for_write(), hostname="t@test", enabled=True)


def test_closing_publishes_what_lingers(redis_server: EmbeddedRedis) -> None:
    app, dispatcher = _dispatcher(redis_server.url)
    tap = EventTap(redis_server.url)
    flusher = EventFlusher(linger_s=60.0)  # the thread would wait a minute: close() must not
    flusher.attach(dispatcher)
    for kind in TASK_EVENTS:
        dispatcher.send(kind, uuid="r-1")
    tap.read(lambda t: bool(t.messages), timeout_s=0.5)
    assert tap.messages == []  # still lingering
    flusher.close()  # what a warm shutdown does
    tap.read(lambda t: t.has_all(["r-1"]))
    assert [key for key, _ in tap.messages] == ["task.multi"] and tap.has_all(["r-1"])
    dispatcher.close()
    app.close()


def test_a_consumer_restart_hands_the_buffer_to_the_next_dispatcher(redis_server: EmbeddedRedis) -> None:
    """What ``Events.start`` does after a lost connection: the next dispatcher publishes the old one's buffer."""
    app, first = _dispatcher(redis_server.url)
    tap = EventTap(redis_server.url)
    flusher = EventFlusher(linger_s=60.0)
    flusher.attach(first)
    for kind in TASK_EVENTS:
        first.send(kind, uuid="r-2")
    flusher.detach()  # the consumer stops: no Redis command, the events move to the outbound buffer
    assert not any(first._group_buffer.values()) and len(first._outbound_buffer) == 1
    first.close()
    _, second = _dispatcher(redis_server.url)
    second.extend_buffer(first)
    second.flush()
    flusher.attach(second)
    tap.read(lambda t: t.has_all(["r-2"]))
    assert tap.has_all(["r-2"]) and [key for key, _ in tap.messages] == ["task.multi"]
    flusher.close()
    second.close()
    app.close()
