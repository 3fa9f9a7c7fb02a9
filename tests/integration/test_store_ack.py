"""``broker.store_ack``: a SUCCESS's ack runs inside the script that stores it; other outcomes keep
kombu's ack; nothing is left unacked (real redis-server, real worker, Redis's own MONITOR)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import states

from broker import make_celery, result_backend
from broker.store_ack import ACKS, StoreAckingQoS, StoreAcks, delivery_tag_of
from protocol.celeryconf import celery_config
from protocol.errors import FleetError
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet
from tests.integration.redis_monitor import Monitor
from tools.redis_server import EmbeddedRedis


def _tag_of(r: redis.Redis[bytes], rid: str, commands: list[dict[str, Any]]) -> str:
    """The delivery tag kombu gave ``rid``'s message (from its ZADD/HSET as MONITOR saw them)."""
    hset = next(c["command"] for c in commands if c["command"].startswith("HSET unacked ") and rid in c["command"])
    return str(hset.split(" ")[2])


def test_a_success_is_acked_by_its_store_script_and_a_failure_by_kombu(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    client.result(client.submit("demo-lm", [1, 2]), wait=True, timeout_s=60)  # connections and the script
    monitor = Monitor(fleet.redis_url)
    good = [client.submit("demo-lm", [3, i + 4]) for i in range(3)]
    for rid in good:
        assert client.result(rid, wait=True, timeout_s=60) is not None
    bad = client.app.send_task("fleet.infer", args=[{"model": "demo-lm", "input_ids": [1, "two"]}],
                               queue=client.settings.queue_for("demo-lm"))  # fails on the worker: DecodeError
    with pytest.raises(FleetError):
        client.result(bad.id, wait=True, timeout_s=60)
    fleet.workers[0].stop(timeout_s=20)  # every ack has landed
    commands = monitor.up_to_now()
    monitor.close()
    for rid in good:
        tag = _tag_of(r, rid, commands)
        hdels = [c for c in commands if c["command"] == f"HDEL unacked {tag}"]
        assert [c["client_type"] for c in hdels] == ["lua"], hdels  # inside EVALSHA, and only there
    bad_tag = _tag_of(r, bad.id, commands)
    assert [c["client_type"] for c in commands if c["command"] == f"HDEL unacked {bad_tag}"] == ["tcp"]
    assert r.hlen("unacked") == 0 and r.zcard("unacked_index") == 0  # nothing left to redeliver


def test_the_script_acks_when_it_keeps_a_success_and_leaves_other_states_to_kombu(redis_server: EmbeddedRedis) -> None:
    app = make_celery(celery_config(load_settings(redis_url=redis_server.url)), "store-ack-test")
    result_backend.install(app)
    backend = app.backend
    r = redis.Redis(port=redis_server.port)

    def delivered(tag: str) -> SimpleNamespace:
        r.hset("unacked", tag, b"[]")
        r.zadd("unacked_index", {tag: 1.0})
        ACKS.expect(tag, "unacked", "unacked_index")
        return SimpleNamespace(properties={"delivery_tag": tag})

    backend.store_result("t1", {"n": 1}, states.SUCCESS, request=delivered("tag-1"))
    assert not r.hexists("unacked", "tag-1") and r.zscore("unacked_index", "tag-1") is None
    assert ACKS.settle("tag-1") is True  # Celery's ack that follows sends nothing

    backend.store_result("t1", {"n": 1}, states.SUCCESS, request=delivered("tag-2"))  # a redelivered copy
    assert not r.hexists("unacked", "tag-2") and ACKS.settle("tag-2") is True  # kept the SUCCESS, acked

    for state, tag in ((states.STARTED, "tag-3"), (states.FAILURE, "tag-4")):  # not ready, or maybe requeued
        backend.store_result(f"t-{tag}", None, state, request=delivered(tag))
        assert r.hexists("unacked", tag) and ACKS.settle(tag) is False  # kombu's own ack removes it

    backend.store_result("t5", {"n": 5}, states.SUCCESS, request=SimpleNamespace(properties={"delivery_tag": "x"}))
    assert ACKS.settle("x") is False  # a tag this process never took: no keys to ack
    app.close()


def test_store_acks_forgets_the_oldest_and_reads_tags() -> None:
    acks = StoreAcks(limit=1)
    acks.expect("a", "unacked", "unacked_index")
    acks.acked("a")
    acks.expect("b", "unacked", "unacked_index")  # "a" dropped with its acked mark
    assert acks.keys_for("a") is None and acks.settle("a") is False and len(acks) == 1
    assert delivery_tag_of(SimpleNamespace(properties={"delivery_tag": "t"})) == "t"
    assert delivery_tag_of(SimpleNamespace(properties=None)) is None and delivery_tag_of(None) is None


def test_a_token_is_free_from_its_result_write_not_from_celery_s_settling() -> None:
    """The worker's prefetch (its tokens): a delivery whose result the store script wrote and acked no
    longer holds one, though Celery settles the ack a moment later on the task's thread. Before, a burst
    queued right after the previous one's results was taken short of those tokens and its last requests
    joined steps late (test_generation's start-together test failed 1 time in 3 with hiredis)."""
    qos: Any = object.__new__(StoreAckingQoS)  # the bookkeeping alone: kombu's dicts, no channel
    qos.prefetch_count, qos._delivered, qos._dirty, qos.acks = 2, {"a": 1, "b": 2}, set(), StoreAcks()
    for tag in ("a", "b"):
        qos.acks.expect(tag, "unacked", "unacked_index")
    assert not qos.can_consume() and qos.can_consume_max_estimate() == 0
    qos.acks.storing("b")  # b's store script runs: the take frees its token once its entry is gone
    assert qos.can_consume_max_estimate() == 0 and qos.acks.storing_among(qos._delivered) == ["b"]
    qos.acks.store_failed("b")  # it did not run: b holds its token until Celery acks it
    assert qos.acks.storing_among(qos._delivered) == []
    qos.acks.storing("a")
    qos.acks.acked("a")  # the store script wrote a's result and removed its unacked entry
    assert qos.can_consume() and qos.can_consume_max_estimate() == 1
    assert qos.acks.settle("a")  # Celery's ack: kombu then marks it dirty; counted once, not twice
    qos._dirty.add("a")
    assert qos.can_consume_max_estimate() == 1
    qos.acks.expect("z", "unacked", "unacked_index")
    qos.acks.acked("z")  # acked, but a delivery of another channel (an earlier connection's): frees nothing here
    assert qos.can_consume_max_estimate() == 1
    qos.prefetch_count = 0
    assert qos.can_consume() and qos.can_consume_max_estimate() is None
