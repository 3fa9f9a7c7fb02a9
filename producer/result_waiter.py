"""Wait for one stored result by pub/sub: ``SUBSCRIBE``, ``GET``, then the message; one pub/sub per thread.

The worker stores a result under ``celery-task-meta-<id>`` and publishes it on the channel of the
same name (Celery's Redis backend protocol; :mod:`broker.result_backend` writes it). Celery's
``AsyncResult.get`` waits the same way, through promises, buckets, a result consumer and a drainer:
``fleet bench`` with py-spy put that at 41 % of a producer's CPU on the ``fleet.infer`` path.
:class:`ResultWaiter` sends the same three commands with none of that machinery:

1. ``SUBSCRIBE`` the result's channel, and wait for Redis to confirm it: the ``GET`` goes on another
   connection, and Redis may serve that connection first, so without the confirmation a result
   stored between the ``GET`` and the ``SUBSCRIBE`` was neither read nor heard (the waiter then sat
   until :data:`RECHECK_S`; ``fleet bench`` caught one 5 s request in 2,600);
2. ``GET`` the key: a result stored before the subscription took effect is read there;
3. read messages until one of a ready state (SUCCESS, FAILURE, REVOKED) arrives on that channel
   (a generation's STARTED is published too, and skipped), then ``UNSUBSCRIBE``. A wait given the request's
   cancel mark reads the key and the mark again on a message that is not an outcome: a cancel for good
   publishes one (:func:`protocol.cancel_marks.cancel_wake`), so the wait ends the moment the request is
   cancelled in its queue, not when a worker reaches it or :data:`RECHECK_S` has passed.

Each wait holds a ``PubSub`` connection of its own (a pub/sub socket is one reader's), borrowed from the
waiter's idle ones and given back when it ends, whatever thread it ran on: a burst waited on from a new
thread pool reuses the connections of the last one instead of paying a connect and redis-py's hand-shake
per thread (in ``fleet bench``'s same-weights burst, 16 such set-ups stretched the 16 submits beside
them from ~20 ms to 70–150 ms). A lost connection is re-opened (by redis-py, which re-subscribes, or
here) and the key read again, since a message published meanwhile is gone; with no message for
:data:`RECHECK_S` seconds the key is read again too, so nothing strands a waiter.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.client

from protocol.cancel_marks import cancelled_before_run
from protocol.redis_conn import await_subscription

__all__ = ["CANCELLED_BEFORE_RUN", "READY_STATES", "RECHECK_S", "ResultWaiter"]

log = logging.getLogger(__name__)

READY_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
"""Celery states after which a result no longer changes."""
MAX_IDLE_PUBSUBS = 64
"""Most idle pub/sub connections a waiter keeps for the next waits."""
CANCELLED_BEFORE_RUN: dict[str, Any] = {"status": "REVOKED", "result": None, "cancelled_before_run": True}
"""What :meth:`ResultWaiter.wait` returns for a request cancelled while queued (a REVOKED meta no worker stored)."""
RECHECK_S = 5.0
"""Seconds without a message after which the key is read again (a safety net, not the way results come)."""
_RECONNECT_PAUSE_S = 0.1


def _close(pubsub: redis.client.PubSub) -> None:
    with contextlib.suppress(Exception):  # already broken: nothing to release
        pubsub.close()


class _NotingPubSub(redis.client.PubSub):
    """redis-py's pub/sub, noting each (re)connect: redis-py reconnects and re-subscribes by itself, and a
    message published while it was away is gone, so the waiter reads the key again."""

    reconnected = False

    def on_connect(self, connection: Any) -> None:
        self.reconnected = True
        super().on_connect(connection)  # type: ignore[no-untyped-call]


class ResultWaiter:
    """Waits on result keys of ``client``'s Redis; ``decode`` turns a stored value into Celery's meta dict."""

    def __init__(self, client: redis.Redis[bytes], decode: Callable[[bytes], dict[str, Any]]) -> None:
        self.client = client
        self.decode = decode
        self._idle: list[_NotingPubSub] = []
        """Pub/sub connections no wait holds now, reused by the next (of any thread)."""
        self._closed = False
        self._lock = threading.Lock()

    def _borrow(self) -> _NotingPubSub:
        """An idle pub/sub connection, or a new one: a new connection costs a connect and redis-py's
        hand-shake, which many short-lived waiting threads (a pool per burst) would pay each time."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _NotingPubSub(self.client.connection_pool)  # subscribe confirmations are awaited

    def _give_back(self, pubsub: _NotingPubSub) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_PUBSUBS:
                self._idle.append(pubsub)
                return
        _close(pubsub)

    def close(self) -> None:
        """Release the idle pub/sub connections (those of waits under way are closed when they end)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for pubsub in idle:
            _close(pubsub)

    def _ready(self, raw: bytes | None) -> dict[str, Any] | None:
        if raw is None:
            return None
        meta = self.decode(raw)
        return meta if meta.get("status") in READY_STATES else None

    def wait(
        self, key: str | bytes, timeout_s: float | None, *, cancel_mark: str | None = None
    ) -> dict[str, Any] | None:
        """The meta stored under ``key`` once it is in a ready state; None after ``timeout_s`` seconds
        (None: no limit).

        With ``cancel_mark`` (the request's cancel-mark key), a read that finds nothing stored under ``key``
        (not even STARTED) while the mark says cancelled for good ends the wait with
        :data:`CANCELLED_BEFORE_RUN`: the request was cancelled while it was queued, and no worker may ever
        store why (a cancel asked of a worker that holds the request waits for what that worker stores:
        :mod:`protocol.cancel_marks`). The mark is read in
        the same round trip as the key, so the wait costs no more than before.

        Raises:
            redis.RedisError: only what a plain ``GET`` of the key raises after a reconnect.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        channel = key if isinstance(key, bytes) else key.encode()
        while True:
            pubsub = self._borrow()
            try:
                pubsub.subscribe(key)
                try:
                    meta = self._wait_subscribed(pubsub, key, channel, deadline, cancel_mark)
                finally:
                    pubsub.unsubscribe(key)
            except redis.ConnectionError as exc:  # the pub/sub connection went: a new one, the key read again
                log.debug("result wait on %s: %s; reconnecting", key, exc)
                _close(pubsub)
                if deadline is not None and time.monotonic() >= deadline:
                    return self._ready(self.client.get(key))
                time.sleep(_RECONNECT_PAUSE_S)
                continue
            except BaseException:
                _close(pubsub)  # in an unknown state: not reused
                raise
            self._give_back(pubsub)
            return meta

    def _read(self, key: str | bytes, cancel_mark: str | None) -> dict[str, Any] | None:
        """The ready meta under ``key``, :data:`CANCELLED_BEFORE_RUN` (see :meth:`wait`), or None."""
        if cancel_mark is None:
            return self._ready(self.client.get(key))
        with self.client.pipeline(transaction=False) as pipe:
            pipe.get(key)
            pipe.get(cancel_mark)
            raw, mark = pipe.execute()
        return CANCELLED_BEFORE_RUN if cancelled_before_run(raw, mark) else self._ready(raw)

    def _wait_subscribed(
        self, pubsub: Any, key: str | bytes, channel: bytes, deadline: float | None, cancel_mark: str | None = None
    ) -> dict[str, Any] | None:
        pubsub.reconnected = False
        recheck_at = time.monotonic() + RECHECK_S
        await_subscription(pubsub, channel, recheck_at if deadline is None else min(deadline, recheck_at))
        meta = self._read(key, cancel_mark)
        while meta is None:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            if now >= recheck_at or pubsub.reconnected:
                pubsub.reconnected = False
                meta = self._read(key, cancel_mark)
                recheck_at = now + RECHECK_S
                continue
            until = recheck_at if deadline is None else min(deadline, recheck_at)
            message = pubsub.get_message(timeout=max(0.0, until - now))
            if message and message.get("type") == "message" and message.get("channel") == channel:
                meta = self._ready(message["data"])
                if meta is None and cancel_mark is not None:  # not an outcome: a cancel's wake-up, or a STARTED
                    meta = self._read(key, cancel_mark)  # (protocol.cancel_marks.cancel_wake): the mark decides
        return meta

