"""The worker's stream publisher: token events to Redis Streams, cancel marks back to sequences.

The scheduler thread must never wait on Redis, so sequences hand their events to
:meth:`StreamPublisher.publish_token` (a token: a tuple into a queue, encoded later by
:func:`protocol.streams.encode_token`) and :meth:`StreamPublisher.publish` (a final or error event),
which only queue them. One publisher thread drains the queue and writes every pending event in one run
of :data:`WRITE_SCRIPT`: **one ``XADD … MAXLEN ~`` per stream** holding all of that stream's pending
events (up to :data:`MAX_EVENTS_PER_ENTRY`, :func:`protocol.streams.encode_events`), plus an ``EXPIRE``
for a stream's first write, for its last event (the key expires ``ttl_s`` after it) and otherwise at
most once per quarter of ``ttl_s`` (a stream cut before its end expires between three quarters of
``ttl_s`` and ``ttl_s`` after its last write). A decode step emits one token per stream, so a stream's
tokens share an entry when they waited for the same write: ``window_ms`` (``worker.stream_window_ms``)
is how long the publisher lets events gather before it writes, which coalesces the tokens of several
decode steps on purpose. A later token does not wake the publisher: while any stream is open it
collects once per window. A stream's first token and its last event wake it and are written at once
(with whatever is pending), so the window never delays the first token; the last event of a
generation ``fleet.infer`` runs is queued once its result is stored (:mod:`workers.stream_ends`), so a
reader that saw a stream end finds its result. In the same loop it reads the cancel marks (``fleet:cancel:<id>``) of the
generations this worker runs, one ``MGET`` per ``cancel_poll_s``, and flags the cancelled ones; the
scheduler ends them at its next step. A second thread listens on the ``fleet:cancels`` channel, where
cancels are also published, so a cancel usually lands within one decode step; the poll catches any it
missed. The same listener hands every ID it hears to :attr:`StreamPublisher.waiting`
(:mod:`workers.cancel_watch`), which ends a one-step request still waiting for its batch; once subscribed
(at start, after a reconnect) it reads back the marks of those waiting, with one ``MGET``, for cancels
published while it was not.

While Redis does not answer (a restart, a cut), events are held in order
(:class:`workers.stream_buffer.PendingEvents`, bounded by events and bytes) and written when it
answers again, tried :data:`FIRST_RETRY_S` doubling to :data:`MAX_RETRY_S` apart; the start and end
of such an outage are logged with the events held, written and refused. What overflows is counted
(:attr:`StreamPublisher.dropped`, ``fleet_worker_stream_events_dropped_total``) and logged; readers
finish such a stream from the stored result (:mod:`producer.streams`). A command Redis refuses for
good (not an outage: a key of another type, say) drops that event, logged and counted the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
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
from protocol.keys import CANCEL_CHANNEL, CANCEL_KEY, STREAM_KEY
from protocol.streams import EVENT_FIELD, REST_FIELD, StreamEvent, encode_events, encode_token
from workers.cancel_watch import CancelWatch
from workers.generation.sequence import GenSequence
from workers.stream_buffer import DEFAULT_MAX_BYTES, DEFAULT_MAX_EVENTS, HeldEvent, PendingEvents
from workers.stream_ends import EndsAfterStore

__all__ = ["FIRST_RETRY_S", "MAX_EVENTS_PER_ENTRY", "MAX_RETRY_S", "WRITE_CHUNK", "StreamPublisher", "asks_to_generate"]

log = logging.getLogger("fleet.streams")

_STOP = ("", None)
TokenOut = tuple[int, int, str]
"""A token as :meth:`StreamPublisher.publish_token` queues it: index, token id, text."""
FIRST_RETRY_S = 0.05
"""First wait before writing again after Redis did not answer (s); doubles up to :data:`MAX_RETRY_S`."""
MAX_RETRY_S = 1.0
"""Longest wait between two writes while Redis does not answer (s)."""
WRITE_CHUNK = 1024
"""Most events one pipeline writes (a long outage's backlog goes out in order, chunk by chunk)."""
MAX_EVENTS_PER_ENTRY = 64
"""Most events of one stream coalesced into one entry."""
IDLE_WAIT_S = 1.0
"""Longest wait of an idle publisher (no events held, no stream open, no generation watched), in seconds."""
_MAX_OPEN_STREAMS = 100_000
"""Most open streams remembered."""
_MAX_EXPIRE_MARKS = 100_000
"""Most streams whose last ``EXPIRE`` time is remembered."""
_OUTAGE_PREFIXES = ("OOM", "MASTERDOWN", "TRYAGAIN", "BUSY", "LOADING")
"""Replies that say Redis cannot write *now*: the events are kept and written later."""
_OUTAGE_REPLIES = (*_OUTAGE_PREFIXES, "READONLY", "NOREPLICAS", "MISCONF")
"""The same, as :data:`WRITE_SCRIPT` hands back a command's error (a replica after a failover, too few
replicas, a failing snapshot are passing states as well)."""
WRITE_SCRIPT = """
local maxlen, ttl, payload = ARGV[1], ARGV[2], ARGV[3]
local out = {}
local at = 1
for i = 1, #KEYS do
  local stop = string.find(payload, '\\30', at, true) or (#payload + 1)
  local cut = string.find(payload, '\\n', at + 1, true)
  local reply
  if cut and cut < stop then
    reply = redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'e', string.sub(payload, at + 1, cut - 1),
                        'r', string.sub(payload, cut + 1, stop - 1))
  else
    reply = redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'e', string.sub(payload, at + 1, stop - 1))
  end
  if type(reply) == 'table' and reply.err then
    out[i] = reply.err
  else
    out[i] = 1
    if string.byte(payload, at) == 49 then redis.pcall('EXPIRE', KEYS[i], ttl) end
  end
  at = stop + 1
end
return out
"""
"""One write of the publisher: KEYS are the entries' streams (a stream twice for two entries), ARGV the
``MAXLEN ~`` cap, the TTL (s) and the entries, each as ``1`` when its stream's ``EXPIRE`` is due after it
(else ``0``), its ``e`` field and, when it has one, a newline and its ``r`` field, separated by ``\\x1e``
(JSON never holds a raw control character). Returns per entry 1, or the error Redis gave its ``XADD``.
One command with three arguments besides the keys, not a pipeline of an ``XADD`` per entry: redis-py packs
each argument and parses each reply in Python, which was most of the publisher's CPU
(``fleet bench --only streaming``)."""


def asks_to_generate(payload: Any) -> bool:
    """Whether a request payload asks to generate (its stream, if any, is this publisher's to end). Such a
    request's STARTED state is stored even with ``celery.track_started`` off, since a generation runs long
    enough for ``running`` to matter and ``cancel`` reads it."""
    output = payload.get("output") if isinstance(payload, dict) else None
    return isinstance(output, dict) and (output.get("kind") == "generate" or output.get("generation") is not None)


def bytes_to_text(reply: bytes | str | int) -> str:
    """A script reply element as text."""
    return reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)


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
    ) -> None:
        """``max_held_events``/``max_held_bytes`` bound what is held while Redis does not answer;
        ``window_ms`` delays a write until the oldest pending event is that old (0: write at once);
        ``max_events_per_entry`` caps the events of one entry (1: an ``XADD`` per event, as before coalescing).

        ``client`` is the publisher's own: its redis-py retries are turned off, since they would block
        this thread (up to 10 tries) while events pile up unbounded in the queue; the publisher
        retries by itself, with its bounded hold.
        """
        client.set_retry(Retry(NoBackoff(), 0))  # type: ignore[attr-defined]  # types-redis predates set_retry
        self.redis = client
        self._script_sha = hashlib.sha1(WRITE_SCRIPT.encode()).hexdigest()
        self._conn: Any = None
        """The connection of the writes, taken from ``client``'s pool once and kept (:meth:`_run_write`)."""
        self.ttl_s = ttl_s
        self.max_len = max_len
        self.cancel_poll_s = cancel_poll_s
        self.pending = PendingEvents(max_held_events, max_held_bytes)
        self.refused = 0
        """Events Redis refused for good (counted in :attr:`dropped` too)."""
        self._stop_deadline_s = float("inf")
        self._queue: queue.SimpleQueue[tuple[str, StreamEvent | TokenOut | None]] = queue.SimpleQueue()
        self._watched: dict[str, GenSequence] = {}
        self.waiting = CancelWatch(forget_after_s=ttl_s)
        """One-step requests waiting for their batch, ended by a cancel the listener hears (an ID heard is
        remembered ``ttl_s``, as long as its cancel mark lives)."""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="fleet-streams", daemon=True)
        self._listener = threading.Thread(target=self._listen, name="fleet-cancels", daemon=True)
        self._stopping = threading.Event()
        self.published = 0
        """Events written."""
        self.entries = 0
        """Stream entries written (``published / entries`` = events per entry)."""
        self.window_s = max(0.0, window_ms) / 1000
        self._wake = threading.Event()
        """Set by :meth:`publish` for a first token or a stream's end (every event without a window), by
        :meth:`watch` and :meth:`stop`: the publisher's wait ends at once."""
        self._open: set[str] = set()
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
        self._expired_at: dict[str, float] = {}
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
        self._listener.start()

    @property
    def dropped(self) -> int:
        """Events never written: over the hold's bounds, or refused by Redis for good."""
        return self.pending.dropped + self.refused

    def stop(self, timeout_s: float = 10.0) -> None:
        """Publish what is queued (trying for up to ``timeout_s`` while Redis does not answer), then stop."""
        self._stop_deadline_s = time.monotonic() + max(0.0, timeout_s - 0.5)
        for request_id, events in self.ends.release_all():  # every stream this worker ends, ends
            self._queue_ends(request_id, events)
        self._stopping.set()
        self._queue.put(_STOP)
        self._wake.set()
        self._thread.join(timeout_s)
        self._listener.join(timeout_s)

    def _flag(self, request_id: str) -> None:
        with self._lock:
            seq = self._watched.get(request_id)
        if seq is not None:
            seq.cancel_requested = True
        self.waiting.heard(request_id)

    def _listen(self) -> None:
        """Flag watched sequences and end waiting one-step requests whose ID arrives on the cancel channel
        (reconnects on errors)."""
        while not self._stopping.is_set():
            try:
                pubsub = self.redis.pubsub()
                pubsub.subscribe(CANCEL_CHANNEL)
                try:
                    while not self._stopping.is_set():
                        message = pubsub.get_message(timeout=0.2)
                        if not message:
                            continue
                        if message.get("type") == "message":
                            data = message["data"]
                            self._flag(data.decode() if isinstance(data, bytes) else str(data))
                        elif message.get("type") == "subscribe":  # every cancel is heard from now on: read
                            self._catch_up()  # back those published before
                finally:
                    pubsub.close()
            except redis.RedisError as exc:
                log.warning("cancel listener: %s; retrying", exc)
                self._stopping.wait(1.0)

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
        with self._lock:
            self._watched[seq.request_id] = seq
        self._wake.set()  # an idle publisher starts polling the cancel marks

    def unwatch(self, request_id: str) -> None:
        """Stop checking ``request_id``'s cancel mark."""
        with self._lock:
            self._watched.pop(request_id, None)

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
        outage = _Outage()
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
                    self._poll_cancels()
                next_poll = now + self.cancel_poll_s
            cpu_now = time.thread_time()
            self.cpu_s += cpu_now - cpu_mark
            cpu_mark = cpu_now
            if stopping and (not len(self.pending) or time.monotonic() >= self._stop_deadline_s):
                break
        if len(self.pending):
            log.warning("stream publisher stopped with %d events unwritten (Redis did not answer); "
                        "their readers finish from the stored results", len(self.pending))
        if self._conn is not None:
            self.redis.connection_pool.release(self._conn)
            self._conn = None

    def _sleep(self, next_poll_s: float, outage: _Outage, *, stopping: bool) -> None:
        """Wait until there is something to do: held events due (at once when urgent or without a window,
        else when the window of the oldest closes; after an outage, when the retry is due), the events of
        open streams to collect (every window: tokens do not wake this thread), the next cancel poll while
        generations are watched, or a wake from :meth:`publish` (a first token, an end, every event
        without a window), :meth:`watch` or :meth:`stop`; otherwise up to :data:`IDLE_WAIT_S`."""
        now = time.monotonic()
        until = []
        if len(self.pending):
            if stopping or self._urgent or not self.window_s:
                until.append(outage.retry_at_s)
            else:
                until.append(max(outage.retry_at_s, self._held_since_s + self.window_s))
        elif self._open and self.window_s:
            until.append(self._drained_s + self.window_s)
        elif stopping:
            return
        if self._watched:  # read without the lock: a stale answer costs one early or late poll
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
        """Note a stream whose tokens are coming (until its last event)."""
        if len(self._open) >= _MAX_OPEN_STREAMS:
            self._open.clear()  # streams that never ended (none should): forgotten, not piled up
        self._open.add(request_id)

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
        """One run of :data:`WRITE_SCRIPT`: each stream's events of ``chunk`` as entries of up to
        ``max_events_per_entry`` (in order), and ``EXPIRE`` on the streams due for one."""
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
        keys: list[str] = []
        entries: list[str] = []
        sizes: list[int] = []
        for key, events in by_key.items():
            for i in range(0, len(events), self.max_events_per_entry):
                entry = events[i : i + self.max_events_per_entry]
                fields = encode_events([held.event for held in entry])
                rest = f"\n{fields[REST_FIELD]}" if REST_FIELD in fields else ""
                last_entry = i + self.max_events_per_entry >= len(events)
                keys.append(key)
                entries.append(f"{int(last_entry and key in expiring)}{fields[EVENT_FIELD]}{rest}")
                sizes.append(len(entry))
        replies = self._run_write(keys, [self.max_len, self.ttl_s, "\x1e".join(entries)])
        errors = [bytes_to_text(r) for r in replies if r != 1]
        passing = next((e for e in errors if e.startswith(_OUTAGE_REPLIES)), None)
        if passing is not None:  # the whole chunk again: a reader drops the entries it already has (by index)
            raise redis.ResponseError(passing)
        refused = sum(n for n, r in zip(sizes, replies, strict=True) if r != 1)
        if refused:
            self.refused += refused
            log.warning("stream publisher: Redis refused %d events (%s); their readers finish from the "
                        "stored results", refused, errors[0])
        self.published += len(chunk) - refused
        self.entries += len(keys)
        now = time.monotonic()
        for key in expiring:
            if by_key[key][-1].last:
                self._expired_at.pop(key, None)
            else:
                self._expired_at[key] = now

    def _run_write(self, keys: list[str], args: list[str | int]) -> list[Any]:
        """One ``EVALSHA`` of :data:`WRITE_SCRIPT` on the publisher's own connection (``SCRIPT LOAD`` first
        when Redis does not know it: a first write, a restarted Redis).

        The connection is taken from the client's pool once and kept: a write is then a send and a read,
        with none of the client's per-command pool, lock and retry steps, which were a quarter of a
        write's CPU. Redis not answering raises as any command does (the connection reconnects at the
        next write).

        Raises:
            redis.RedisError: the write did not run.
        """
        if self._conn is None:
            self._conn = self.redis.connection_pool.get_connection()
        conn = self._conn
        command = ("EVALSHA", self._script_sha, len(keys), *keys, *args)
        conn.send_command(*command)
        try:
            reply: list[Any] = conn.read_response()
            return reply
        except redis.exceptions.NoScriptError:
            conn.send_command("SCRIPT", "LOAD", WRITE_SCRIPT)
            conn.read_response()
        conn.send_command(*command)
        reply = conn.read_response()
        return reply

    def _due_for_expire(self, by_key: dict[str, list[HeldEvent]]) -> list[str]:
        """Streams of this write whose ``EXPIRE`` is due: the first write of a stream, its last event (so
        the key expires ``ttl_s`` after it), and otherwise once per quarter of ``ttl_s``."""
        if len(self._expired_at) > _MAX_EXPIRE_MARKS:
            self._expired_at.clear()  # forgotten streams get an EXPIRE again at their next write
        now = time.monotonic()
        return [
            key for key, events in by_key.items()
            if events[-1].last or now - self._expired_at.get(key, -1e18) >= self.ttl_s / 4
        ]

    def _catch_up(self) -> None:
        """End the waiting one-step requests whose cancel was published while the listener was not subscribed
        (the marks are set before they are announced). Nothing waits at start; after a reconnect, one ``MGET``."""
        ids = self.waiting.ids()
        if not ids:
            return
        marks = self.redis.mget([CANCEL_KEY.format(id=rid) for rid in ids])
        for rid, mark in zip(ids, marks, strict=True):
            if mark is not None:
                self._flag(rid)

    def _poll_cancels(self) -> None:
        with self._lock:
            watched = list(self._watched.values())
        live = [s for s in watched if not s.cancel_requested and not s.future.done()]
        if not live:
            return
        marks = self.redis.mget([CANCEL_KEY.format(id=s.request_id) for s in live])
        for seq, mark in zip(live, marks, strict=True):
            if mark is not None:
                seq.cancel_requested = True


class _Outage:
    """When to write again while Redis does not answer, and what to log at its start and end."""

    def __init__(self) -> None:
        self.down_since_s: float | None = None
        self.retry_at_s = 0.0
        self.delay_s = FIRST_RETRY_S
        self.published_before = 0
        self.dropped_before = 0

    def failed(self, publisher: StreamPublisher, exc: BaseException, now_s: float) -> None:
        if self.down_since_s is None:
            self.down_since_s, self.delay_s = now_s, FIRST_RETRY_S
            self.published_before, self.dropped_before = publisher.published, publisher.dropped
            log.warning("stream publisher: Redis does not answer (%s); holding %d events until it does",
                        exc, len(publisher.pending))
        else:
            self.delay_s = min(MAX_RETRY_S, self.delay_s * 2)
        self.retry_at_s = now_s + self.delay_s

    def ended(self, publisher: StreamPublisher) -> None:
        if self.down_since_s is None:
            return
        log.warning("stream publisher: Redis answers again after %.1f s; wrote %d held events, %d dropped",
                    time.monotonic() - self.down_since_s, publisher.published - self.published_before,
                    publisher.dropped - self.dropped_before)
        self.down_since_s, self.retry_at_s = None, 0.0
