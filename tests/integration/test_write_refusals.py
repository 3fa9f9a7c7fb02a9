"""Redis refusing writes for a while (MISCONF, NOREPLICAS, READONLY, OOM) must not stop a worker.

The refusal is real and reversible: ``CONFIG SET min-replicas-to-write 1`` on a primary with no
replica makes Redis answer every write ``NOREPLICAS`` until it is set back to 0 — the same class of
answer as ``MISCONF`` from a full AOF disk (tests/integration/test_faults.py), without needing a
disk to fill. Before broker/redis_refusals.py the worker's ``BRPOP`` got that answer in Celery's
event loop, Celery called it an "Unrecoverable error" and the worker exited.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from broker.redis_refusals import ParkedItems, RedisRefusingWrites, is_write_refusal
from tests.integration.fault_fixtures import Load, settle
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import wait_until
from tools.redis_server import EmbeddedRedis

VISIBILITY_S = 5


@pytest.fixture()
def server() -> Iterator[EmbeddedRedis]:
    srv = EmbeddedRedis()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _refuse_writes(r: redis.Redis[bytes], refuse: bool) -> None:
    r.config_set("min-replicas-to-write", 1 if refuse else 0)


def _refusals(r: redis.Redis[bytes]) -> int:
    """How many writes Redis has answered ``NOREPLICAS`` (``INFO errorstats``, Redis >= 6.2)."""
    stats = r.info("errorstats")
    return int(stats.get("errorstat_NOREPLICAS", {}).get("count", 0))


def test_write_refusal_answers_are_recognised_and_others_are_not(server: EmbeddedRedis) -> None:
    r = redis.Redis.from_url(server.url)
    r.rpush("a-list", b"x")
    with pytest.raises(redis.exceptions.ResponseError) as wrongtype:
        r.incr("a-list")
    assert not is_write_refusal(wrongtype.value)
    _refuse_writes(r, True)
    try:
        # a ResponseError, or RedisRefusingWrites where a worker's guard is installed in this process
        with pytest.raises(redis.exceptions.RedisError) as plain:
            r.set("k", "v")
        with pytest.raises(redis.exceptions.RedisError) as piped:
            r.pipeline(transaction=True).zadd("z", {"m": 1.0}).hset("h", "f", "v").execute()
    finally:
        _refuse_writes(r, False)
    assert str(plain.value).startswith("NOREPLICAS"), plain.value
    assert is_write_refusal(plain.value) and is_write_refusal(piped.value), (plain.value, piped.value)
    assert is_write_refusal(RedisRefusingWrites("x"))
    # Celery reconnects on a ConnectionError; that is what the worker turns a refusal into
    assert issubclass(RedisRefusingWrites, redis.exceptions.ConnectionError)


def test_a_parked_message_goes_back_to_its_queue_once_redis_accepts_writes(server: EmbeddedRedis) -> None:
    r = redis.Redis.from_url(server.url)
    r.rpush("fleet.demo-lm", b"older")
    parked = ParkedItems(lambda: redis.Redis.from_url(server.url), retry_s=0.05)
    _refuse_writes(r, True)
    try:
        refused_before = _refusals(r)
        parked.park("fleet.demo-lm", b'{"body": "held"}')
        # three of its push-backs refused (Redis counts each NOREPLICAS answer), or the message let go
        wait_until(lambda: _refusals(r) >= refused_before + 3 or not parked.pending(), 10,
                   "Redis to refuse three push-backs")
        assert parked.pending() == 1  # Redis still refuses: it is held, not dropped
        assert r.lrange("fleet.demo-lm", 0, -1) == [b"older"]
    finally:
        _refuse_writes(r, False)
    wait_until(lambda: parked.pending() == 0, 10, "the held message to go back")
    # pushed back at the end BRPOP takes from: it is the next message served
    assert r.brpop(["fleet.demo-lm"], timeout=1) == (b"fleet.demo-lm", b'{"body": "held"}')


def test_worker_survives_redis_refusing_writes_under_load_and_loses_nothing(fleet: Fleet) -> None:
    cfg = fleet.config(visibility_timeout_s=VISIBILITY_S, worker={"heartbeat_s": 0.5},
                       models={"demo-lm": {"batching": {"max_wait_ms": 200, "close_when_idle": False}}})
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    load = Load(client, 20.0).start()
    try:
        wait_until(lambda: len(load.accepted) >= 20, 20, "load before the refusal")
        _refuse_writes(r, True)
        wait_until(lambda: sum(load.refused.values()) > 0, 20, "Redis to refuse a submission")
        time.sleep(3.0)
        _refuse_writes(r, False)
        accepted_before = len(load.accepted)
        wait_until(lambda: len(load.accepted) >= accepted_before + 30, 30, "load after writes are accepted again")
    finally:
        _refuse_writes(r, False)
        load.stop()
    completed, lost, errors = settle(client, load.ids, 3 * VISIBILITY_S + 20)
    alive = worker.proc is not None and worker.proc.poll() is None
    print(f"accepted {len(load.accepted)}, completed {completed}, lost {len(lost)}, refused "
          f"{sum(load.refused.values())}, worker alive {alive}")
    assert alive, "the worker exited:\n" + worker.log_tail()
    assert "Unrecoverable error" not in worker.log_tail(500_000)
    assert not lost and not errors, (lost, errors)
    assert completed == len(load.accepted)


def test_a_channel_used_after_its_connection_closed_is_a_lost_connection(server: EmbeddedRedis) -> None:
    """An ack from a task thread racing the consumer's reconnect reached kombu's ``_connparams`` with the
    connection gone: AttributeError in the event loop, "Unrecoverable error", the worker exited (1 Redis
    restart in 5 in the fault matrix). It must be an error Celery reconnects on."""
    from kombu.connection import Connection
    from kombu.transport import redis as kombu_redis
    from redis._parsers.base import BaseParser

    from broker import poison

    before = (kombu_redis.Transport.Channel, dict(BaseParser.EXCEPTION_CLASSES))
    poison.install()  # what a worker process does; undone below so this process's clients stay stock
    try:
        conn = Connection(server.url)  # type: ignore[no-untyped-call]
        channel = conn.channel()  # type: ignore[no-untyped-call]
        assert isinstance(channel, poison.GuardedChannel)
        recoverable = conn.connection_errors
        conn.close()  # type: ignore[no-untyped-call]
        with pytest.raises(redis.exceptions.ConnectionError) as lost:
            channel._connparams()
        assert isinstance(lost.value, recoverable), (type(lost.value), recoverable)
    finally:
        kombu_redis.Transport.Channel = before[0]
        BaseParser.EXCEPTION_CLASSES.clear()
        BaseParser.EXCEPTION_CLASSES.update(before[1])
