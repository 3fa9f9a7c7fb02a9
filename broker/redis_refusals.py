"""Redis refusing writes for a while is a broker outage, not a reason for a worker to exit.

Redis answers a write with an error, and accepts it again later without a restart, when:

- ``MISCONF``: it cannot persist (a full disk for the AOF, a failed background save);
- ``NOREPLICAS``: fewer replicas than ``min-replicas-to-write`` are in sync;
- ``READONLY``: the address now points at a replica (a Sentinel failover in progress);
- ``OOM``: ``maxmemory`` is reached under a ``noeviction`` policy;
- ``MASTERDOWN``: a replica lost its primary.

kombu counts these among *channel* errors, so one of them in the worker's event loop (the ``BRPOP``
that takes a message, or the write that records it as unacked) reached Celery as an
"Unrecoverable error" and every worker exited at once (docs/reliability.md, the full-AOF-disk
row). :class:`RedisRefusingWrites` is a :class:`redis.exceptions.ConnectionError`, which Celery does
treat as a lost connection: it reconnects with backoff and carries on when Redis accepts writes.

:class:`ParkedItems` keeps the one kind of message such a refusal can strand: popped by ``BRPOP`` a
moment before the refusal began, so no longer in the queue, and refused by the write that records
it as unacked. It is pushed back to its queue as soon as Redis takes writes again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

__all__ = [
    "WRITE_REFUSAL_CODES",
    "BrokerChannelClosed",
    "ParkedItems",
    "RedisRefusingWrites",
    "is_write_refusal",
    "raise_write_refusals_as_connection_errors",
]

log = logging.getLogger("fleet.worker")

WRITE_REFUSAL_CODES = ("MISCONF", "NOREPLICAS", "READONLY", "OOM", "MASTERDOWN")
"""Error codes with which Redis refuses a write for a condition that clears without a restart."""

_PIPELINE_MARK = "caused error: "
"""redis-py re-raises a pipeline command's error as ``Command # N (...) of pipeline caused error: <reply>``."""


class RedisRefusingWrites(redis.exceptions.ConnectionError):
    """Redis refused a write for a condition that clears by itself (see :data:`WRITE_REFUSAL_CODES`)."""

    def __init__(self, message: str = "", status_code: str | None = None) -> None:
        # redis-py's parser passes the reply without its code; keep the code in the message
        super().__init__(f"{status_code} {message}" if status_code else message)


class BrokerChannelClosed(redis.exceptions.ConnectionError):
    """kombu's channel was used after its connection closed (an ack racing the consumer's reconnect)."""


def is_write_refusal(exc: BaseException) -> bool:
    """True for Redis's answer to a write it refuses for now (``MISCONF …``, ``NOREPLICAS …``, …)."""
    if isinstance(exc, RedisRefusingWrites):
        return True
    if not isinstance(exc, redis.exceptions.ResponseError):
        return False
    if isinstance(exc, redis.exceptions.ReadOnlyError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    reply = str(exc)
    if _PIPELINE_MARK in reply:
        reply = reply.split(_PIPELINE_MARK, 1)[1]
    return reply.split(" ", 1)[0].upper() in WRITE_REFUSAL_CODES


def raise_write_refusals_as_connection_errors() -> None:
    """In this process, make redis-py raise :class:`RedisRefusingWrites` for ``MISCONF``, ``NOREPLICAS``, ``OOM``.

    redis-py maps an error reply's code to an exception class (its parsers' ``EXCEPTION_CLASSES``)
    and raises a ConnectionError class at once, dropping the connection. That is the one place that
    covers every write kombu makes inside Celery's event loop (``BRPOP``, recording a delivery as
    unacked, the ``restore_visible`` lock, acks), where any other error class stops the worker.
    ``READONLY`` and ``MASTERDOWN`` keep their classes (Sentinel clients already turn ``READONLY``
    into a ConnectionError); :func:`is_write_refusal` still recognises them. Worker processes only.
    """
    from redis._parsers.base import BaseParser

    classes: dict[str, object] = BaseParser.EXCEPTION_CLASSES
    for code in ("MISCONF", "NOREPLICAS", "OOM"):
        classes[code] = RedisRefusingWrites


class ParkedItems:
    """Queue items popped from Redis that Redis then refused to record; pushed back when it accepts writes.

    ``push_back(list_key, item)`` is called with the item to return; a daemon thread retries every
    ``retry_s`` seconds until it succeeds. Items are pushed back with ``RPUSH`` (the end ``BRPOP``
    takes from), so the message is the next one served, as it would have been.
    """

    def __init__(self, client_factory: Callable[[], redis.Redis[bytes]], retry_s: float = 0.5) -> None:
        self._client_factory = client_factory
        self._retry_s = retry_s
        self._items: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: redis.Redis[bytes] | None = None

    def park(self, list_key: str, item: bytes) -> None:
        """Hold ``item`` (popped from ``list_key``) until it can be pushed back."""
        with self._lock:
            self._items.append((list_key, item))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fleet-parked-items", daemon=True)
                self._thread.start()
        log.warning("Redis refused to record a message taken from %s: holding it (%d bytes) until Redis "
                    "accepts writes again, then returning it to the queue", list_key, len(item))
        self._wake.set()

    def pending(self) -> int:
        """Items still held."""
        with self._lock:
            return len(self._items)

    def flush(self) -> int:
        """Try once to push every held item back; returns how many are still held."""
        with self._lock:
            items = list(self._items)
        if not items:
            return 0
        try:
            if self._client is None:
                self._client = self._client_factory()
            client = self._client
            for list_key, item in items:
                client.rpush(list_key, item)
                with self._lock:
                    self._items.remove((list_key, item))
                log.warning("returned a held message to %s", list_key)
        except redis.exceptions.RedisError as exc:
            log.info("cannot return %d held message(s) yet: %s", len(items), exc)
        return self.pending()

    def _run(self) -> None:
        while self.flush():
            self._wake.wait(self._retry_s)
            self._wake.clear()
