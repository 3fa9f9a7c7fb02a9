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
:attr:`~protocol.streams.StreamEvent.is_last`) is handed on — even one with a lower index, as a
redelivered attempt that ran out of time would write — and the iterator stops after it; a ``final``
whose tokens were not all handed on is a gap (below).

``timeout_s`` bounds the silence, not the whole stream: each entry that arrives (a replayed one too)
restarts it, and :class:`~protocol.errors.ResultTimeout` is raised when nothing arrived for that long.

A stream can stop short while its request finished (events lost in a Redis restart, trimmed by
``MAXLEN``, a worker that could not write them). Given ``outcome`` (a reader of the stored result),
a reader looks for the result whenever a block ran out empty, and at once when a token index skips
ahead (a gap: the missing events can no longer come); found, it finishes from it
(:func:`producer.stream_ending.ending_events`: same indexes, same text, nothing twice) instead of
waiting for events that will never be written. While Redis does not answer, a reader reconnects,
waiting :data:`FIRST_RETRY_S` doubling to :data:`MAX_RETRY_S` between tries (the fleet's one backoff
schedule, :mod:`protocol.backoff`, as the stream publisher's), for at most ``max_outage_s`` and never past
its silence bound (``timeout_s`` after the last entry); then the Redis error is raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypedDict, Unpack

import redis
import redis.asyncio

from producer.stream_ending import ending_events
from protocol.backoff import FIRST_RETRY_S, MAX_RETRY_S, Backoff
from protocol.errors import FleetError, ResultTimeout
from protocol.keys import STREAM_KEY
from protocol.messages import InferenceResult
from protocol.streams import StreamEvent, decode_events

__all__ = [
    "FIRST_RETRY_S",
    "MAX_OUTAGE_S",
    "MAX_RETRY_S",
    "READ_COUNT",
    "Entry",
    "Reconnect",
    "StreamCursor",
    "StreamRead",
    "aiter_event_batches",
    "aiter_events",
    "iter_events",
    "stream_entries",
]

READ_COUNT = 256
"""Most entries one ``XREAD`` returns."""
MAX_OUTAGE_S = 30.0
"""Default longest time a reader keeps trying while Redis does not answer (s)."""

Outcome = InferenceResult | FleetError
"""A finished request's stored result or error."""

Entry = tuple[Any, dict[Any, Any]]
"""One stream entry as redis-py returns it: ``(entry id, fields)``."""
StreamRead = Callable[[str, "str | bytes", int], Awaitable[list[Entry]]]
"""``read(key, last_id, block_ms)``: the entries of stream ``key`` after ``last_id``, waiting up to
``block_ms`` ms for some ([] when none came); what :func:`aiter_events` reads with."""


class StreamCursor:
    """Where a reader stands in one stream: the entry id read up to, the highest token index handed on
    (and the text they showed), whether events were missed, and when its silence runs out (``timeout_s``
    ``inf``: never). Pure: times come in as arguments (``time.monotonic()`` seconds)."""

    def __init__(self, request_id: str, *, now_s: float, timeout_s: float, block_ms: int = 1000) -> None:
        if not timeout_s > 0 or block_ms < 1:  # NaN too
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0 (inf: no limit) and block_ms ({block_ms}) >= 1")
        self.key = STREAM_KEY.format(id=request_id)
        self.request_id = request_id
        self.timeout_s = timeout_s
        self.block_ms = block_ms
        self.last_id: str | bytes = "0-0"
        self.highest_index = -1
        self.finished = False
        self.deadline_s = now_s + timeout_s
        self.gap = False
        """True once an event skipped ahead of the next token index: the ones between will never come."""
        self.result_checked_s = now_s
        self._shown: list[str] = []

    @property
    def shown_text(self) -> str:
        """The text of every event handed on so far."""
        return "".join(self._shown)

    def accept(self, event: StreamEvent) -> bool:
        """True when ``event`` is for the caller: the next token index, or the stream's end.

        A token index past the next one, or a ``final`` whose tokens were not all handed on, is held
        back and sets :attr:`gap` (the stored result fills it in: :meth:`finish_from`). A ``final`` at
        or below the highest index (a redelivered attempt that hit its deadline) and ``error`` always go.
        """
        if self.finished:
            return False
        if event.type == "error" or (event.type == "final" and event.index <= self.highest_index + 1):
            self.finished = True
            self._shown.append(event.text)
            return True
        if event.type == "final" or event.index > self.highest_index + 1:
            self.gap = True
            return False
        if event.index <= self.highest_index:
            return False
        self.highest_index = event.index
        self._shown.append(event.text)
        return True

    def result_due(self, now_s: float, got_entries: bool) -> bool:
        """Whether to look for the stored result now: the block ran out empty, or a gap is open and
        the last look is ``block_ms`` old."""
        if self.finished:
            return False
        return not got_entries or (self.gap and now_s - self.result_checked_s >= self.block_ms / 1000)

    def finish_from(self, outcome: Outcome, now_s: float) -> list[StreamEvent]:
        """The events that end the stream from the stored ``outcome`` (see :mod:`producer.stream_ending`)."""
        self.result_checked_s = now_s
        events = ending_events(
            self.request_id, outcome, highest_index=self.highest_index, shown_text=self.shown_text
        )
        for event in events:
            self.accept(event)
        self.finished = True
        return events

    def feed(self, entries: Sequence[Entry], now_s: float) -> list[StreamEvent]:
        """The new events among ``entries`` (read after :attr:`last_id`), in order; restarts the silence.

        Raises:
            DecodeError: an entry is not a stream event.
        """
        if entries:
            self.last_id = entries[-1][0]
            self.deadline_s = now_s + self.timeout_s
        return [event for _, fields in entries for event in decode_events(fields) if self.accept(event)]

    def read(self, reply: Any, now_s: float) -> list[StreamEvent]:
        """The new events of one ``XREAD`` reply (see :meth:`feed`).

        Raises:
            ResultTimeout: the reply is empty and nothing arrived for ``timeout_s``.
            DecodeError: an entry is not a stream event.
        """
        entries = stream_entries(reply)
        if not entries and self.timed_out(now_s):
            raise self.timeout_error()
        return self.feed(entries, now_s)

    def xread_args(self, now_s: float) -> tuple[dict[str, str | bytes], int, int]:
        """``(streams, count, block)`` for the next ``XREAD``."""
        return {self.key: self.last_id}, READ_COUNT, self.block_for_ms(now_s)

    def block_for_ms(self, now_s: float) -> int:
        """How long the next ``XREAD BLOCK`` may wait (ms; never 0, which would mean forever)."""
        left_ms = (self.deadline_s - now_s) * 1000
        return self.block_ms if left_ms >= self.block_ms else max(1, round(left_ms))  # inf (no limit): block_ms

    def timed_out(self, now_s: float) -> bool:
        """True when nothing arrived for ``timeout_s``."""
        return now_s >= self.deadline_s

    def outage_wait_s(self, retry: Reconnect, now_s: float) -> float | None:
        """How long to wait before trying Redis again after a failed call at ``now_s``: ``retry``'s wait,
        cut to what is left of the silence (``timeout_s`` bounds the wait for an event whatever keeps it
        away, Redis too); None once Redis has not answered for ``retry.max_outage_s`` or the silence ran out
        (the caller raises the Redis error)."""
        wait_s = retry.failed(now_s)
        left_s = self.deadline_s - now_s
        return None if wait_s is None or left_s <= 0 else min(wait_s, left_s)

    def timeout_error(self) -> ResultTimeout:
        """The error a reader raises once :meth:`timed_out`."""
        what = "no event" if self.highest_index < 0 else f"no event after token {self.highest_index}"
        return ResultTimeout(
            f"{what} in the stream of {self.request_id} within {self.timeout_s} s", "timeout_s", self.timeout_s
        )


def stream_entries(reply: Any) -> list[Entry]:
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


class Reconnect(Backoff):
    """Waits between reads while Redis does not answer: :data:`FIRST_RETRY_S` doubling to
    :data:`MAX_RETRY_S`, for at most ``max_outage_s`` from the first failure. Pure (times as arguments)."""

    def __init__(self, max_outage_s: float) -> None:
        super().__init__()
        self.max_outage_s = max_outage_s

    def failed(self, now_s: float) -> float | None:
        """Seconds to wait before the next try; None once Redis has not answered for ``max_outage_s``."""
        down_since_s = now_s if self.down_since_s is None else self.down_since_s  # none on: this one starts
        delay_s = self.next_wait_s(now_s)
        left_s = down_since_s + self.max_outage_s - now_s
        return None if left_s <= 0 else min(delay_s, left_s)


RETRIED = (redis.ConnectionError, redis.TimeoutError)
"""What a reader retries: Redis unreachable, restarting (``LOADING`` is a ConnectionError), or slow."""


class ReadOptions(TypedDict, total=False):
    """:func:`aiter_events`' and :func:`aiter_event_batches`' optional arguments (see them)."""

    block_ms: int
    outcome: Callable[[], Awaitable[Outcome | None]] | None
    max_outage_s: float
    read: StreamRead | None


async def aiter_events(
    aredis: redis.asyncio.Redis[bytes], request_id: str, *, timeout_s: float, **options: Unpack[ReadOptions]
) -> AsyncIterator[StreamEvent]:
    """Each event of ``request_id``'s stream once, waiting with ``XREAD BLOCK`` on ``aredis`` (no thread),
    or with ``read`` (one wait shared by many streams: :class:`gateway.stream_hub.StreamHub`).

    Stops after the last event (``final`` or ``error``). ``block_ms`` (default 1000) is the longest single
    wait. ``outcome()`` returns the request's stored result or error (None while it has none); with it, a
    stream that stopped short ends from the stored result (see the module's docstring). ``max_outage_s``
    (default :data:`MAX_OUTAGE_S`) bounds the retries while Redis does not answer.

    Raises:
        ResultTimeout: nothing arrived for ``timeout_s`` seconds.
        DecodeError: an entry is not a stream event.
        redis.ConnectionError, redis.TimeoutError: Redis did not answer for ``max_outage_s``, or while the
            silence ran out (``timeout_s`` after the last entry).
    """
    async for batch in aiter_event_batches(aredis, request_id, timeout_s=timeout_s, **options):
        for event in batch:
            yield event


async def aiter_event_batches(
    aredis: redis.asyncio.Redis[bytes],
    request_id: str,
    *,
    timeout_s: float,
    block_ms: int = 1000,
    outcome: Callable[[], Awaitable[Outcome | None]] | None = None,
    max_outage_s: float = MAX_OUTAGE_S,
    read: StreamRead | None = None,
) -> AsyncIterator[list[StreamEvent]]:
    """:func:`aiter_events`' events, as the reads return them: one non-empty list per read (a relay then
    writes what one read brought in one piece). Same arguments and errors as :func:`aiter_events`."""
    cursor = StreamCursor(request_id, now_s=time.monotonic(), timeout_s=timeout_s, block_ms=block_ms)
    retry = Reconnect(max_outage_s)
    while not cursor.finished:
        try:
            if read is None:
                entries = stream_entries(await aredis.xread(*cursor.xread_args(time.monotonic())))
            else:
                entries = await read(cursor.key, cursor.last_id, cursor.block_for_ms(time.monotonic()))
            retry.answered()
        except RETRIED as exc:
            await asyncio.sleep(_retry_wait(cursor, retry, exc))
            continue
        fed = cursor.feed(entries, time.monotonic())
        if fed:
            yield fed
        if outcome is not None and cursor.result_due(time.monotonic(), bool(entries)):
            try:
                stored = await outcome()
            except RETRIED as exc:
                await asyncio.sleep(_retry_wait(cursor, retry, exc))
                continue
            ending = _ending(cursor, stored)
            if ending:
                yield ending
        _check_silence(cursor, entries)


def iter_events(
    redis_client: redis.Redis[bytes],
    request_id: str,
    *,
    timeout_s: float,
    block_ms: int = 1000,
    outcome: Callable[[], Outcome | None] | None = None,
    max_outage_s: float = MAX_OUTAGE_S,
) -> Iterator[StreamEvent]:
    """The blocking twin of :func:`aiter_events` (one thread per open stream); same events, same errors.

    ``redis_client``'s ``socket_timeout`` (if any) must exceed ``block_ms``.
    """
    cursor = StreamCursor(request_id, now_s=time.monotonic(), timeout_s=timeout_s, block_ms=block_ms)
    retry = Reconnect(max_outage_s)
    while not cursor.finished:
        try:
            entries = stream_entries(redis_client.xread(*cursor.xread_args(time.monotonic())))
            retry.answered()
        except RETRIED as exc:
            time.sleep(_retry_wait(cursor, retry, exc))  # the caller's thread waits for Redis: nothing else to do
            continue
        yield from cursor.feed(entries, time.monotonic())
        if outcome is not None and cursor.result_due(time.monotonic(), bool(entries)):
            try:
                stored = outcome()
            except RETRIED as exc:
                time.sleep(_retry_wait(cursor, retry, exc))
                continue
            yield from _ending(cursor, stored)
        _check_silence(cursor, entries)


def _retry_wait(cursor: StreamCursor, retry: Reconnect, exc: redis.RedisError) -> float:
    """How long to wait before trying Redis again after ``exc``; raises ``exc`` past the outage bound or once
    the reader's silence ran out (:meth:`StreamCursor.outage_wait_s`)."""
    wait_s = cursor.outage_wait_s(retry, time.monotonic())
    if wait_s is None:
        raise exc
    return wait_s


def _ending(cursor: StreamCursor, stored: Outcome | None) -> list[StreamEvent]:
    """The events that end the stream from ``stored`` (none while the request has no stored result)."""
    now_s = time.monotonic()
    cursor.result_checked_s = now_s
    return cursor.finish_from(stored, now_s) if stored is not None and not cursor.finished else []


def _check_silence(cursor: StreamCursor, entries: list[Entry]) -> None:
    """Raise ResultTimeout when the last read was empty and the stream is silent for ``timeout_s``."""
    if not cursor.finished and not entries and cursor.timed_out(time.monotonic()):
        raise cursor.timeout_error()
