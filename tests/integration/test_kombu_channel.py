"""``broker.kombu_channel`` and the worker path's Redis commands: one client per channel and pool, no
``MULTI``/``EXEC`` per delivery, one store script per result (real redis-server and worker)."""

from __future__ import annotations

import time

from kombu.transport import redis as kombu_redis

from bench.procs import redis_commandstats
from broker import make_celery
from broker.kombu_channel import FleetChannel, PlainPipelineQoS
from protocol.celeryconf import celery_config
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet
from tools.redis_server import EmbeddedRedis

PROBE = {"info", "hello", "client"}  # redis_commandstats's own connection


def settled_calls(redis_url: str, before: dict[str, int], acks: int, wait_s: float = 10.0) -> dict[str, int]:
    """Commands since ``before``, read once the worker has acked ``acks`` deliveries (``HDEL``).

    With ``acks_late`` the result is stored and published before the ack, so a client can hold its
    last result while the worker's ``HDEL`` is still on its way; reading at once races with it."""
    deadline = time.monotonic() + wait_s
    while True:
        after = redis_commandstats(redis_url)
        calls = {k: v - before.get(k, 0) for k, v in after.items() if k not in PROBE}
        if calls.get("hdel", 0) >= acks or time.monotonic() > deadline:
            return calls
        time.sleep(0.05)


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
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    for i in range(2):  # connections, the script and the routing state are set up here
        client.result(client.submit("demo-lm", [1, i + 2]), wait=True, timeout_s=60)
    before = redis_commandstats(fleet.redis_url)
    for i in range(10):
        assert client.result(client.submit("demo-lm", [3, i + 4]), wait=True, timeout_s=60) is not None
    calls = settled_calls(fleet.redis_url, before, acks=10)
    assert calls.get("multi", 0) == 0 and calls.get("exec", 0) == 0, calls  # plain pipelines and a script
    assert calls["lpush"] == 10 and calls["zadd"] == 10 and calls["hdel"] == 10
    # scripts: one take (broker.atomic_take: ZADD + HSET + LTRIM inside, run only when a list holds a
    # message) and one store (the ack's HDEL inside) per request, beside the producer's own
    assert calls["ltrim"] == 10 and calls["evalsha"] >= 20 and not calls.get("brpop") and not calls.get("rpop"), calls
    assert calls.get("incrby", 0) <= 4, calls  # the drain meter: twice a second, not per request
    assert calls["subscribe"] == 10 and calls["unsubscribe"] == 10


def test_flower_sees_each_result_as_its_repr(fleet: Fleet) -> None:
    """The task-succeeded event carries the result's text (workers.result_repr), as Flower shows it."""
    import base64
    import json

    import redis

    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    events = redis.Redis.from_url(fleet.redis_url).pubsub(ignore_subscribe_messages=True)
    events.psubscribe("*celeryev/task.*")  # task.succeeded, or task.multi when Celery sends them buffered
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
