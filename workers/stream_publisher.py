"""The worker's stream publisher: token events to Redis Streams, cancel marks back to sequences.

The scheduler thread must never wait on Redis, so sequences hand their events to
:meth:`StreamPublisher.publish_token` (a token: a tuple into a queue, encoded later by
:func:`protocol.streams.encode_token`) and :meth:`StreamPublisher.publish` (a final or error event),
which only queue them. One publisher thread drains the queue and writes every pending event in one run
of :data:`workers.stream_write_script.WRITE_SCRIPT`: **one ``XADD … MAXLEN ~`` per stream** holding all
of that stream's pending events (up to :data:`MAX_EVENTS_PER_ENTRY`, :func:`protocol.streams.encode_events`),
plus an ``EXPIRE`` for a stream's first write, for its last event (the key expires ``ttl_s`` after it)
and otherwise at most once per quarter of ``ttl_s`` (a stream cut before its end expires between three
quarters of ``ttl_s`` and ``ttl_s`` after its last write). A decode step emits one token per stream, so a
stream's tokens share an entry when they waited for the same write: ``window_ms``
(``worker.stream_window_ms``) is how long the publisher lets events gather before it writes, which
coalesces the tokens of several decode steps on purpose. A later token does not wake the publisher: while
any stream is open it collects once per window. A stream's first token and its last event wake it and are
written at once (with whatever is pending), so the window never delays the first token; the last event of
a generation ``fleet.infer`` runs is queued once its result is stored (:mod:`workers.stream_ends`), so a
reader that saw a stream end finds its result.

In the same loop it reads the cancel marks (``fleet:cancel:<id>``) of the generations this worker runs,
one ``MGET`` per ``cancel_poll_s`` (s), and flags the cancelled ones; the scheduler ends them at its next
step. A second thread listens on the ``fleet:cancels`` channel, where cancels are also published, so a
cancel usually lands within one decode step; the poll catches any it missed. Both are
:class:`workers.cancel_listener.CancelListener`'s (:attr:`StreamPublisher.cancels`); the listener also
ends the one-step requests still waiting for their batch (:attr:`StreamPublisher.waiting`).

While Redis does not answer (a restart, a cut), events are held in order
(:class:`workers.stream_buffer.PendingEvents`, bounded by events and bytes) and written when it
answers again, tried :data:`FIRST_RETRY_S` doubling to :data:`MAX_RETRY_S` apart
(:mod:`workers.stream_outage`); the start and end of such an outage are logged with the events held,
written and refused. What overflows is counted (:attr:`StreamPublisher.dropped`,
``fleet_worker_stream_events_dropped_total``) and logged; readers finish such a stream from the stored
result (:mod:`producer.streams`). A command Redis refuses for good (not an outage: a key of another type,
say) drops that event, logged and counted the same way.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from protocol.errors import FleetError
from protocol.keys import STREAM_KEY
from protocol.streams import StreamEvent, encode_token
from workers.cancel_listener import CancelListener
from workers.generation.sequence import GenSequence
from workers.recent_marks import RecentMarks
from workers.stream_buffer import DEFAULT_MAX_BYTES, DEFAULT_MAX_EVENTS, HeldEvent, PendingEvents
from workers.stream_ends import EndsAfterStore
from workers.stream_outage import FIRST_RETRY_S, MAX_RETRY_S, Outage
from workers.stream_write_script import ScriptConnection, refusals, script_arguments

__all__ = ["FIRST_RETRY_S", "MAX_EVENTS_PER_ENTRY", "MAX_EXPIRE_MARKS", "MAX_OPEN_STREAMS", "MAX_RETRY_S",
           "WRITE_CHUNK", "StreamPublisher", "asks_to_generate"]  # fmt: skip

log = logging.getLogger("fleet.streams")

_STOP = ("", None)
TokenOut = tuple[int, int, str]
"""A token as :meth:`StreamPublisher.publish_token` queues it: index, token id, text."""
WRITE_CHUNK = 1024
"""Most events one pipeline writes (a long outage's backlog goes out in order, chunk by chunk)."""
MAX_EVENTS_PER_ENTRY = 64
"""Most events of one stream coalesced into one entry."""
IDLE_WAIT_S = 1.0
"""Longest wait of an idle publisher (no events held, no stream open, no generation watched), in seconds."""
MAX_OPEN_STREAMS = 100_000
"""Default most open streams remembered; past it the one opened longest ago is forgotten
(:mod:`workers.recent_marks`)."""
MAX_EXPIRE_MARKS = 100_000
"""Default most streams whose last ``EXPIRE`` time is remembered; past it the one set longest ago is forgotten (it
gets an ``EXPIRE`` again at its next write)."""


def asks_to_generate(payload: Any) -> bool:
    """Whether a request payload asks to generate (its stream, if any, is this publisher's to end). Such a
    request's STARTED state is stored even with ``celery.track_started`` off, since a generation runs long
    enough for ``running`` to matter and ``cancel`` reads it."""
    output = payload.get("output") if isinstance(payload, dict) else None
    return isinstance(output, dict) and (output.get("kind") == "generate" or output.get("generation") is not None)


class StreamPublisher:
    """Publishes generation events and watches cancel marks (one thread per worker)."""

    def __init__(
        self,
        client: redis.Redis[bytes],
        *,
        ttl_s: int,
        max_len: int = 4096,
        cancel_poll_s: float = 0.02,
        max_held_events: int = DEFAULT_MAX_EVENTS,
        max_held_bytes: int = DEFAULT_MAX_BYTES,
        window_ms: float = 0.0,
        max_events_per_entry: int = MAX_EVENTS_PER_ENTRY,
        max_open_streams: int = MAX_OPEN_STREAMS,
        max_expire_marks: int = MAX_EXPIRE_MARKS,
    ) -> None:
        """``max_held_events``/``max_held_bytes`` bound what is held while Redis does not answer;
        ``window_ms`` delays a write until the oldest pending event is that old (0: write at once);
        ``max_events_per_entry`` caps the events of one entry (1: an ``XADD`` per event, as before coalescing);
        ``max_open_streams``/``max_expire_marks`` bound the streams remembered as open and the ``EXPIRE`` times
        remembered (past either, the oldest mark is forgotten; a stream's marks leave with its last event).

        Raises ValueError: a bound < 1.

        ``client`` is the publisher's own: its redis-py retries are turned off, since they would block
        this thread (up to 10 tries) while events pile up unbounded in the queue; the publisher
        retries by itself, with its bounded hold.
        """
        client.set_retry(Retry(NoBackoff(), 0))  # type: ignore[attr-defined]  # types-redis predates set_retry
        self.redis = client
        self._script = ScriptConnection(client)
        """Runs the writes, on a connection of ``client``'s pool kept while busy, given back when idle (swept)."""
        self.ttl_s = ttl_s
        self.max_len = max_len
        self.cancel_poll_s = cancel_poll_s
        self.pending = PendingEvents(max_held_events, max_held_bytes)
        self.refused = 0
        """Events Redis refused for good (counted in :attr:`dropped` too)."""
        self._stop_deadline_s = float("inf")
        self._queue: queue.SimpleQueue[tuple[str, StreamEvent | TokenOut | None]] = queue.SimpleQueue()
        self.cancels = CancelListener(client, ttl_s=ttl_s)
        """The cancel listener thread, and the poll of the watched generations' marks (:meth:`_loop`)."""
        self.waiting = self.cancels.waiting
        """One-step requests waiting for their batch, ended by a cancel the listener hears (an ID heard is
        remembered ``ttl_s``, as long as its cancel mark lives)."""
        self._thread = threading.Thread(target=self._loop, name="fleet-streams", daemon=True)
        self.published = 0
        """Events written."""
        self.entries = 0
        """Stream entries written (``published / entries`` = events per entry)."""
        self.window_s = max(0.0, window_ms) / 1000
        self._wake = threading.Event()
        """Set by :meth:`publish` for a first token or a stream's end (every event without a window), by
        :meth:`watch` and :meth:`stop`: the publisher's wait ends at once."""
        self._open: RecentMarks[None] = RecentMarks(max_open_streams)
        """Streams whose first token was taken and whose last event was not: while any is open, the
        publisher collects events every window (a token does not wake it)."""
        self._urgent = False
        """A stream's first token or its end is held: write without waiting out the window (time to first
        token; the end goes out with the stored result)."""
        self.max_events_per_entry = max(1, max_events_per_entry)
        self._held_since_s = 0.0
        """When the oldest held event may have been published (monotonic s): the last drain before it."""
        self._drained_s = time.monotonic()
        """When the queue was last drained into the hold (monotonic s)."""
        self.cpu_s = 0.0
        """CPU time of the publisher thread so far (s), read at each pass of its loop."""
        self._expired_at: RecentMarks[float] = RecentMarks(max_expire_marks)
        """Stream key → when its TTL was last set (monotonic s), for streams not ended yet."""
        self.ends = EndsAfterStore()
        """Streams whose last event waits for their stored result (:mod:`workers.stream_ends`)."""
        self.before_end: Callable[[], object] | None = None
        """Called (publisher thread) before a write that ends a stream: what must be in Redis before a
        reader learns the generation ended (the prefix digests that route its next turn,
        :meth:`workers.direct_queue.PrefixHolder.sync`, a bounded wait)."""

    def start(self) -> None:
        """Start the publisher and cancel-listener threads."""
        self._thread.start()
        self.cancels.start()

    @property
    def thread(self) -> threading.Thread:
        """The publisher thread (its death makes the worker not ready: :class:`workers.progress.ThreadWatch`)."""
        return self._thread

    @property
    def dropped(self) -> int:
        """Events never written: over the hold's bounds, or refused by Redis for good."""
        return self.pending.dropped + self.refused

    def stop(self, timeout_s: float = 10.0) -> None:
        """Publish what is queued (trying for up to ``timeout_s`` while Redis does not answer), then stop."""
        self._stop_deadline_s = time.monotonic() + max(0.0, timeout_s - 0.5)
        for request_id, events in self.ends.release_all():  # every stream this worker ends, ends
            self._queue_ends(request_id, events)
        self.cancels.stop()
        self._queue.put(_STOP)
        self._wake.set()
        self._thread.join(timeout_s)
        self.cancels.join(timeout_s)

    def publish(self, request_id: str, event: StreamEvent) -> None:
        """Queue ``event`` for the stream of ``request_id`` (never blocks); a stream's first token or end
        cuts short a window being waited out. The end of a stream :meth:`hold_end` marked waits for
        :meth:`stored`."""
        if event.is_last and self.ends.keep(request_id, event):
            return
        self._queue.put((request_id, event))
        if event.is_last or event.index == 0 or not self.window_s:
            self._wake.set()

    def hold_end(self, request_id: str) -> None:
        """Publish the events that end ``request_id``'s stream only once its result is stored
        (:meth:`stored`), so a reader that sees the end finds the result."""
        for let_go, events in self.ends.hold(request_id):
            self._queue_ends(let_go, events)

    def stored(self, request_id: str) -> None:
        """``request_id``'s result is stored (or its task is done without one): publish its stream's held end."""
        self._queue_ends(request_id, self.ends.release(request_id))

    def _queue_ends(self, request_id: str, events: list[StreamEvent]) -> None:
        for event in events:
            self._queue.put((request_id, event))
        if events:
            self._wake.set()

    def publish_token(self, request_id: str, index: int, token_id: int, text: str) -> None:
        """Queue the ``index``-th token of ``request_id``'s stream: what :meth:`publish` does for a token
        event, without building one on the caller's thread (the scheduler's, once per token); it is
        encoded on the publisher's (:func:`protocol.streams.encode_token`)."""
        self._queue.put((request_id, (index, token_id, text)))
        if index == 0 or not self.window_s:
            self._wake.set()

    def watch(self, seq: GenSequence) -> None:
        """Check ``seq``'s cancel mark until :meth:`unwatch`."""
        self.cancels.watch(seq)
        self._wake.set()  # an idle publisher starts polling the cancel marks

    def unwatch(self, request_id: str) -> None:
        """Stop checking ``request_id``'s cancel mark."""
        self.cancels.unwatch(request_id)

    def fail_if_generating(self, request_id: str, payload: Any, exc: BaseException) -> None:
        """End the stream of a failed request that asked to generate with an error event."""
        if not asks_to_generate(payload):
            return
        field = exc.field if isinstance(exc, FleetError) else None
        limit = exc.limit if isinstance(exc, FleetError) else None
        message = exc.args[0] if isinstance(exc, FleetError) and exc.args else str(exc)
        event = StreamEvent(
            type="error", index=0, error=type(exc).__name__, message=str(message), field=field, limit=limit
        )
        self.publish(request_id, event)

    def _loop(self) -> None:
        next_poll = time.monotonic()
        stopping = False
        outage = Outage()
        cpu_mark = time.thread_time()
        while True:
            self._sleep(next_poll, outage, stopping=stopping)
            stopping = self._take(bounded=outage.down_since_s is not None) or stopping
            now = time.monotonic()
            due = stopping or self._urgent or now >= self._held_since_s + self.window_s
            if len(self.pending) and now >= outage.retry_at_s and due:
                try:
                    self._wake.clear()  # before the write: what is published during it wakes the next wait
                    self._write_pending()
                    self._urgent = False
                    outage.ended(self)
                except redis.RedisError as exc:  # whatever it is, the thread lives on and tries again
                    outage.failed(self, exc, now)
            if not stopping and now >= next_poll:
                with contextlib.suppress(redis.RedisError):  # the write path logs an outage; the poll waits
                    self.cancels.poll()
                next_poll = now + self.cancel_poll_s
            if not len(self.pending) and not len(self._open):  # idle: the writes' connection back to the pool,
                self._script.release()  # where the heartbeat's sweep releases it if a Redis restart closed it
            cpu_now = time.thread_time()
            self.cpu_s += cpu_now - cpu_mark
            cpu_mark = cpu_now
            if stopping and (not len(self.pending) or time.monotonic() >= self._stop_deadline_s):
                break
        if len(self.pending):
            log.warning("stream publisher stopped with %d events unwritten (Redis did not answer); "
                        "their readers finish from the stored results", len(self.pending))
        self._script.release()

    def _sleep(self, next_poll_s: float, outage: Outage, *, stopping: bool) -> None:
        """Wait until there is something to do: held events due (at once when urgent or without a window,
        else when the window of the oldest closes; after an outage, when the retry is due), the events of
        open streams to collect (every window: tokens do not wake this thread), the next cancel poll while
        generations are watched, or a wake from :meth:`publish` (a first token, an end, every event
        without a window), :meth:`watch` or :meth:`stop`; otherwise up to :data:`IDLE_WAIT_S`. Once
        stopping, never past the stop's deadline: a retry backed off beyond it is not waited for."""
        now = time.monotonic()
        until = []
        if len(self.pending):
            if stopping:  # the retry is due, or the stop's deadline is, whichever comes first
                until.append(min(outage.retry_at_s, self._stop_deadline_s))
            elif self._urgent or not self.window_s:
                until.append(outage.retry_at_s)
            else:
                until.append(max(outage.retry_at_s, self._held_since_s + self.window_s))
        elif len(self._open) and self.window_s:
            until.append(self._drained_s + self.window_s)
        elif stopping:
            return
        if self.cancels.watching:
            until.append(next_poll_s)
        timeout = min(until) - now if until else IDLE_WAIT_S
        if timeout > 0:
            self._wake.wait(timeout)
        self._wake.clear()  # what is published from here on wakes the next wait

    def _take(self, *, bounded: bool) -> bool:
        """Move what was published into the hold, within its bounds when ``bounded`` (Redis does not
        answer); True when :meth:`stop` asked to stop."""
        stopping = False
        dropped_before = self.pending.dropped
        was_empty = not len(self.pending)
        try:
            item = self._queue.get_nowait()
            while True:
                request_id, out = item
                if out is None:
                    stopping = True
                elif type(out) is tuple:  # a token from publish_token
                    self.pending.add(request_id, encode_token(*out), last=False, bounded=bounded)
                    if out[0] == 0:
                        self._urgent = True
                        self._opened(request_id)
                else:
                    event: StreamEvent = out  # type: ignore[assignment]
                    self.pending.add(request_id, event.model_dump_json(exclude_none=True), last=event.is_last,
                                     bounded=bounded)
                    self._urgent = self._urgent or event.is_last or event.index == 0
                    if event.is_last:
                        self._open.discard(request_id)
                    elif event.index == 0:
                        self._opened(request_id)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass
        if was_empty and len(self.pending):
            self._held_since_s = self._drained_s  # published since the last drain: the oldest may be that old
        self._drained_s = time.monotonic()
        if self.pending.dropped > dropped_before and (
            dropped_before == 0 or self.pending.dropped // 10_000 > dropped_before // 10_000
        ):  # the first drop, then one line per 10,000
            log.warning("stream publisher: %d events held (%d bytes), over the bound (%d events, %d bytes): "
                        "%d events dropped so far; their readers finish from the stored results",
                        len(self.pending), self.pending.bytes, self.pending.max_events, self.pending.max_bytes,
                        self.pending.dropped)
        return stopping

    def _opened(self, request_id: str) -> None:
        """Note a stream whose tokens are coming (until its last event; past ``max_open_streams`` the stream
        opened longest ago, most likely one that never ended, is forgotten)."""
        self._open.mark(request_id, None)

    def _write_pending(self) -> None:
        """Write every held event, oldest first, :data:`WRITE_CHUNK` per pipeline.

        Raises:
            redis.RedisError: Redis did not answer (what was not written stays held, in order).
        """
        while len(self.pending):
            chunk = self.pending.head(WRITE_CHUNK)
            self._write(chunk)
            self.pending.pop(len(chunk))

    def _write(self, chunk: list[HeldEvent]) -> None:
        """One run of :data:`~workers.stream_write_script.WRITE_SCRIPT`: each stream's events of ``chunk`` as
        entries of up to ``max_events_per_entry`` (in order), and ``EXPIRE`` on the streams due for one."""
        if self.before_end is not None and any(held.last for held in chunk):
            self.before_end()
        by_id: dict[str, list[HeldEvent]] = {}
        for held in chunk:
            group = by_id.get(held.request_id)
            if group is None:
                by_id[held.request_id] = [held]
            else:
                group.append(held)
        by_key = {STREAM_KEY.format(id=request_id): events for request_id, events in by_id.items()}
        expiring = set(self._due_for_expire(by_key))
        keys, payload, sizes = script_arguments(by_key, expiring, self.max_events_per_entry)
        replies = self._script.run(keys, [self.max_len, self.ttl_s, payload])
        refused, error = refusals(replies, sizes)  # raises when Redis cannot write now: the whole chunk again
        if refused:
            self.refused += refused
            log.warning("stream publisher: Redis refused %d events (%s); their readers finish from the "
                        "stored results", refused, error)
        self.published += len(chunk) - refused
        self.entries += len(keys)
        now = time.monotonic()
        for key in expiring:
            if by_key[key][-1].last:
                self._expired_at.discard(key)
            else:
                self._expired_at.mark(key, now)

    def _due_for_expire(self, by_key: dict[str, list[HeldEvent]]) -> list[str]:
        """Streams of this write whose ``EXPIRE`` is due: the first write of a stream, its last event (so
        the key expires ``ttl_s`` after it), and otherwise once per quarter of ``ttl_s``."""
        now = time.monotonic()
        return [
            key for key, events in by_key.items()
            if events[-1].last or now - self._expired_at.get(key, -1e18) >= self.ttl_s / 4
        ]
