"""Readers of a generation's token stream (Redis Stream ``fleet:stream:<id>``): sync and asyncio.

::

    for event in iter_events(client.redis, rid, timeout_s=30):            # a thread
        print(event.text, end="")
    async for event in aiter_events(aredis, rid, timeout_s=30):           # the gateway's event loop
        ...

Both read the stream from its start with ``XREAD BLOCK`` (a stream opened before the worker wrote
anything simply waits for its first entry) and hand each token index on once: a redelivered request
regenerates from index 0 into the same stream, so :class:`StreamCursor` drops token indexes at or
below the highest one already handed on. The event that ends the stream (``final`` or ``error``,
:attr:`~protocol.streams.StreamEvent.is_last`) is always handed on — even one with a lower index, as a
redelivered attempt that ran out of time would write — and the iterator stops after it.

``timeout_s`` bounds the silence, not the whole stream: each entry that arrives (a replayed one too)
restarts it, and :class:`~protocol.errors.ResultTimeout` is raised when nothing arrived for that long.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import redis
import redis.asyncio

from protocol.errors import ResultTimeout
from protocol.keys import STREAM_KEY
from protocol.streams import StreamEvent, decode_event

__all__ = ["READ_COUNT", "StreamCursor", "aiter_events", "iter_events"]

READ_COUNT = 256
"""Most entries one ``XREAD`` returns."""

Entry = tuple[Any, dict[Any, Any]]
"""One stream entry as redis-py returns it: ``(entry id, fields)``."""


class StreamCursor:
    """Where a reader stands in one stream: the entry id read up to, the highest token index handed on,
    and when its silence runs out. Pure: times come in as arguments (``time.monotonic()`` seconds)."""

    def __init__(self, request_id: str, *, now_s: float, timeout_s: float, block_ms: int = 1000) -> None:
        if timeout_s <= 0 or block_ms < 1:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0 and block_ms ({block_ms}) >= 1")
        self.key = STREAM_KEY.format(id=request_id)
        self.request_id = request_id
        self.timeout_s = timeout_s
        self.block_ms = block_ms
        self.last_id: str | bytes = "0-0"
        self.highest_index = -1
        self.finished = False
        self.deadline_s = now_s + timeout_s

    def accept(self, event: StreamEvent) -> bool:
        """True when ``event`` is for the caller: a token index above all handed on, or the stream's end."""
        if self.finished:
            return False
        if event.is_last:
            self.finished = True
            return True
        if event.index <= self.highest_index:
            return False
        self.highest_index = event.index
        return True

    def feed(self, entries: Sequence[Entry], now_s: float) -> list[StreamEvent]:
        """The new events among ``entries`` (read after :attr:`last_id`), in order; restarts the silence.

        Raises:
            DecodeError: an entry is not a stream event.
        """
        if entries:
            self.last_id = entries[-1][0]
            self.deadline_s = now_s + self.timeout_s
        return [event for event in (decode_event(fields) for _, fields in entries) if self.accept(event)]

    def read(self, reply: Any, now_s: float) -> list[StreamEvent]:
        """The new events of one ``XREAD`` reply (see :meth:`feed`).

        Raises:
            ResultTimeout: the reply is empty and nothing arrived for ``timeout_s``.
            DecodeError: an entry is not a stream event.
        """
        entries = _entries(reply)
        if not entries and self.timed_out(now_s):
            raise self.timeout_error()
        return self.feed(entries, now_s)

    def xread_args(self, now_s: float) -> tuple[dict[str, str | bytes], int, int]:
        """``(streams, count, block)`` for the next ``XREAD``."""
        return {self.key: self.last_id}, READ_COUNT, self.block_for_ms(now_s)

    def block_for_ms(self, now_s: float) -> int:
        """How long the next ``XREAD BLOCK`` may wait (ms; never 0, which would mean forever)."""
        return max(1, min(self.block_ms, round((self.deadline_s - now_s) * 1000)))

    def timed_out(self, now_s: float) -> bool:
        """True when nothing arrived for ``timeout_s``."""
        return now_s >= self.deadline_s

    def timeout_error(self) -> ResultTimeout:
        """The error a reader raises once :meth:`timed_out`."""
        what = "no event" if self.highest_index < 0 else f"no event after token {self.highest_index}"
        return ResultTimeout(
            f"{what} in the stream of {self.request_id} within {self.timeout_s} s", "timeout_s", self.timeout_s
        )


def _entries(reply: Any) -> list[Entry]:
    """The entries of an ``XREAD`` reply for one key: RESP2 ``[[key, entries]]``, RESP3 ``{key: [entries]}``
    or the unified ``{key: entries}``; None or empty when the block ran out."""
    if not reply:
        return []
    if not isinstance(reply, dict):
        return [(entry_id, fields) for _, entries in reply for entry_id, fields in entries]
    out: list[Entry] = []
    for value in reply.values():
        nested = bool(value) and isinstance(value[0], list)  # RESP3: one list of entries per key
        for entry_id, fields in (value[0] if nested else value):
            out.append((entry_id, fields))
    return out


async def aiter_events(
    aredis: redis.asyncio.Redis[bytes], request_id: str, *, timeout_s: float, block_ms: int = 1000
) -> AsyncIterator[StreamEvent]:
    """Each event of ``request_id``'s stream once, waiting with ``XREAD BLOCK`` on ``aredis`` (no thread).

    Stops after the last event (``final`` or ``error``). ``block_ms`` is the longest single wait.

    Raises:
        ResultTimeout: nothing arrived for ``timeout_s`` seconds.
        DecodeError: an entry is not a stream event.
    """
    cursor = StreamCursor(request_id, now_s=time.monotonic(), timeout_s=timeout_s, block_ms=block_ms)
    while not cursor.finished:
        reply = await aredis.xread(*cursor.xread_args(time.monotonic()))
        for event in cursor.read(reply, time.monotonic()):
            yield event


def iter_events(
    redis_client: redis.Redis[bytes], request_id: str, *, timeout_s: float, block_ms: int = 1000
) -> Iterator[StreamEvent]:
    """The blocking twin of :func:`aiter_events` (one thread per open stream); same events, same errors.

    ``redis_client``'s ``socket_timeout`` (if any) must exceed ``block_ms``.
    """
    cursor = StreamCursor(request_id, now_s=time.monotonic(), timeout_s=timeout_s, block_ms=block_ms)
    while not cursor.finished:
        yield from cursor.read(redis_client.xread(*cursor.xread_args(time.monotonic())), time.monotonic())
