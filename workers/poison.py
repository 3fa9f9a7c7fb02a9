"""Poison-message guard for the Redis broker transport.

kombu's Redis transport decodes each popped queue item with ``json.loads`` inside the worker's
event loop; an item that is not JSON, or not a kombu message envelope, raises there and Celery
stops the whole worker ("Unrecoverable error"). Anyone who can ``LPUSH`` to a queue could take
the fleet down that way. :class:`GuardedChannel` catches those items, moves the raw bytes to the
dead-letter list ``fleet:dead-letter`` (nothing is silently lost) and keeps consuming.

Installed by :func:`install` in the worker process only (producers never decode queue items).
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

__all__ = ["DEAD_LETTER_KEY", "GuardedChannel", "install"]

log = logging.getLogger("fleet.poison")

DEAD_LETTER_KEY = "fleet:dead-letter"
_MAX_DEAD_LETTERS = 10_000


class GuardedChannel(kombu_redis.Channel):
    """kombu's Redis channel, except that undecodable queue items are dead-lettered, not fatal."""

    def _brpop_read(self, **options: Any) -> bool:
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if not dest__item:
                raise kombu_redis.Empty()  # type: ignore[attr-defined]
            dest, item = dest__item
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]  # type: ignore[no-untyped-call]
            self._queue_cycle.rotate(dest)
            try:
                message = loads(bytes_to_str(item))  # type: ignore[no-untyped-call]
                props = message.get("properties") if isinstance(message, dict) else None
                if not isinstance(props, dict) or "body" not in message or not {
                    "delivery_tag", "delivery_info"} <= props.keys():
                    raise ValueError("not a kombu message envelope (body, properties.delivery_tag/info)")
            except (TypeError, ValueError, UnicodeDecodeError) as exc:
                self._dead_letter(dest, item, exc)
                return True
            self.connection._deliver(message, dest)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()

    def _dead_letter(self, queue: str, item: bytes | str, exc: Exception) -> None:
        raw = item if isinstance(item, bytes) else str(item).encode()
        log.error("queue %s: dropped an item that is not a Celery/kombu JSON message (%s); "
                  "moved %d bytes to %s", queue, exc, len(raw), DEAD_LETTER_KEY)
        try:
            with self.conn_or_acquire() as client:
                client.lpush(DEAD_LETTER_KEY, raw)
                client.ltrim(DEAD_LETTER_KEY, 0, _MAX_DEAD_LETTERS - 1)
        except Exception:  # the guard must never become the thing that kills the worker
            log.exception("could not write the dead letter")


def install() -> None:
    """Make every Redis transport in this process use :class:`GuardedChannel`."""
    kombu_redis.Transport.Channel = GuardedChannel
