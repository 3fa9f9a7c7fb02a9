"""``producer.result_waiter``: one stored result, waited for by pub/sub, against a real redis-server."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import redis

from producer import result_waiter
from producer.result_waiter import ResultWaiter
from tools.redis_server import EmbeddedRedis

KEY = "celery-task-meta-abc"


def _meta(status: str) -> bytes:
    return json.dumps({"status": status, "result": {"n": 1}, "task_id": "abc"}).encode()


def _publish_once_subscribed(r: redis.Redis[bytes], values: list[bytes]) -> threading.Thread:
    """Publishes ``values`` on ``KEY`` in turn once Redis counts a subscriber of it (the waiter's), stored
    nowhere: only a publication can end the wait."""

    def run() -> None:
        deadline = time.monotonic() + 10
        while _subscribers(r) == 0 and time.monotonic() < deadline:  # the wait then fails, naming no result
            time.sleep(0.01)
        for value in values:
            r.publish(KEY, value)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _waiter(r: redis.Redis[bytes]) -> ResultWaiter:
    return ResultWaiter(r, lambda raw: dict(json.loads(raw)))


def _subscribers(r: redis.Redis[bytes]) -> int:
    return int(dict(r.pubsub_numsub(KEY))[KEY.encode()])  # type: ignore[index]  # types-redis: str keys; bytes here


def _unsubscribed(r: redis.Redis[bytes], timeout_s: float = 10.0) -> bool:
    """True once Redis counts no subscriber of ``KEY``: the waiter sends UNSUBSCRIBE as it returns, and Redis
    may read it from that connection after a command this test sends on its own."""
    deadline = time.monotonic() + timeout_s
    while _subscribers(r) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _subscribers(r) == 0


def test_a_stored_result_is_read_and_a_published_one_wakes_the_waiter(
    redis_server: EmbeddedRedis, monkeypatch: Any
) -> None:
    monkeypatch.setattr(result_waiter, "RECHECK_S", 3600.0)  # no periodic read: the publication must wake it
    r = redis.Redis(port=redis_server.port)
    waiter = _waiter(r)
    r.set(KEY, _meta("SUCCESS"))  # stored before anyone waits
    assert waiter.wait(KEY, 5) == json.loads(_meta("SUCCESS"))
    r.set(KEY, _meta("STARTED"))  # not ready: a read finds nothing to return
    _publish_once_subscribed(r, [_meta("STARTED"), _meta("FAILURE")])  # a generation's STARTED is skipped
    got: Any = waiter.wait(KEY.encode(), 10)
    assert got is not None and got["status"] == "FAILURE", got
    assert _unsubscribed(r)  # unsubscribed after each wait


def test_a_timeout_returns_none_and_leaves_no_subscription(redis_server: EmbeddedRedis) -> None:
    r = redis.Redis(port=redis_server.port)
    waiter = _waiter(r)
    assert waiter.wait(KEY, 0.3) is None
    assert _unsubscribed(r)


def test_a_killed_pubsub_connection_is_reopened_and_the_result_still_arrives(
    redis_server: EmbeddedRedis, monkeypatch: Any
) -> None:
    monkeypatch.setattr(result_waiter, "RECHECK_S", 30.0)  # the reconnect, not the periodic read, must find it
    r = redis.Redis(port=redis_server.port)
    waiter = _waiter(r)
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(meta=waiter.wait(KEY, 20)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while _subscribers(r) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.client_kill_filter(_type="pubsub") >= 1
    r.set(KEY, _meta("SUCCESS"))  # stored while the waiter has no connection: found by the re-read
    thread.join(15)
    assert box["meta"]["status"] == "SUCCESS"


class _SlowUplink:
    """A TCP relay to ``port`` that holds what clients send for ``delay_s`` (server replies pass at once):
    the pub/sub connection's SUBSCRIBE then reaches Redis after a GET sent later on a direct connection,
    as Redis may serve two connections' commands in either order."""

    def __init__(self, port: int, delay_s: float) -> None:
        import socket

        self.port, self.delay_s = port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listen_port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pipe, args=(client, upstream, self.delay_s), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, 0.0), daemon=True).start()

    @staticmethod
    def _pipe(src: Any, dst: Any, delay_s: float) -> None:
        try:
            while data := src.recv(65536):
                time.sleep(delay_s)
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


def test_a_result_stored_between_the_read_and_the_subscription_is_not_missed(redis_server: EmbeddedRedis) -> None:
    """The waiter reads the key only once Redis has confirmed the subscription; before, it read at once and a
    result stored in between was neither read nor heard until the 5 s recheck."""
    direct = redis.Redis(port=redis_server.port)
    relay = _SlowUplink(redis_server.port, delay_s=0.3)
    waiter = _waiter(redis.Redis(port=relay.listen_port))  # the pub/sub connection goes through the relay
    real_get = direct.get

    def get_then_store(key: Any) -> Any:
        value = real_get(key)
        if value is None:  # the worker stores and publishes right after the waiter's read
            direct.set(KEY, _meta("SUCCESS"))
            direct.publish(KEY, _meta("SUCCESS"))
        return value

    waiter._give_back(waiter._borrow())  # made now, on the relay's pool, kept for the wait; GETs go straight
    waiter.client = direct
    direct.get = get_then_store  # type: ignore[method-assign,assignment]
    try:
        meta = waiter.wait(KEY, timeout_s=3.0)  # under the 5 s recheck: only the message can wake it in time
        assert meta is not None and meta["status"] == "SUCCESS"
    finally:
        waiter.close()
        relay.close()


def test_waits_from_new_threads_reuse_the_idle_connections_of_ended_waits(redis_server: EmbeddedRedis) -> None:
    """A burst waited on from a new thread pool each time (what a caller's per-burst executor does) reuses
    the pub/sub connections of the waits before it: Redis sees no new client for the second burst. Before,
    a connection belonged to its thread and every new thread made one (a connect and a hand-shake)."""
    direct = redis.Redis(port=redis_server.port)
    waiter = _waiter(redis.Redis(port=redis_server.port))
    keys = [f"{KEY}-{i}" for i in range(4)]

    def burst() -> None:
        for key in keys:
            direct.set(key, _meta("SUCCESS"))
        for key in keys:  # each wait on a thread of its own, one after the other
            thread = threading.Thread(target=waiter.wait, args=(key, 10.0))
            thread.start()
            thread.join(15)

    try:
        burst()
        connections = int(direct.info("stats")["total_connections_received"])
        burst()
        assert int(direct.info("stats")["total_connections_received"]) == connections
        assert len(waiter._idle) == 1
    finally:
        waiter.close()
    assert waiter._idle == []
    thread = threading.Thread(target=waiter.wait, args=(keys[0], 10.0))  # a wait that ends after close()
    thread.start()
    thread.join(15)
    assert waiter._idle == []  # its connection was closed, not kept
