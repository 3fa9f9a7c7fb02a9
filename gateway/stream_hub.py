"""One ``XREAD`` for every token stream a gateway relays, instead of one per stream.

Each relayed stream (:func:`gateway.stream_relay.relay_events`) reads its Redis Stream with
``XREAD BLOCK`` from where it stands. Alone, that is one blocking round trip, and one pooled connection
held, per stream per batch of events: 16 generations streamed together cost 16 reads each time the
worker writes (once per ``worker.stream_window_ms``). The worker writes every running stream in one
script call, so their new entries appear together: :class:`StreamHub` waits on all of them with one
``XREAD BLOCK`` naming every stream a reader is waiting on, and hands each reader its own entries. In
``fleet bench --only same-weights``' streaming burst (16 OpenAI SDK streams, 724 tokens) the gateway's
``XREAD`` calls went from 333 to about 140.

Readers keep their own position (``last_id``) and their own logic (:class:`producer.streams.StreamCursor`:
each token once, the silence bound, the stored result as the end of a stream that stopped short): the hub
only multiplexes the waiting, and never holds an entry a reader has not asked for. Once a read returns,
the hub lets the readers it answered come back (:data:`REJOIN_S` at most) before it sends the next, so in
the steady state every stream is in the one read; a reader that comes back later is in the read after
(:data:`HUB_BLOCK_MS` at most, sooner when any stream gets entries), and a stream's first read, while a
read without it is under way, is made on its own (so a new stream's first token never waits for it).

The hub's read starts each stream at the position of its readers furthest on. A reader behind them (a second
reader of a stream joining from its start, a reader whose client is slower than the others) reads on its
own: the entries after its position are there already, so its ``XREAD`` returns at once, :data:`READ_COUNT`
at most, and it comes back for the next. Before, the hub's read started at the position of the reader
furthest behind: a reader more than :data:`READ_COUNT` entries behind made each read return its old
entries only, and the readers already up to date waited a read per :data:`READ_COUNT` entries of its
backlog for their new ones. A reader whose position is before where the read under way started in its
stream is never answered by that read (its reply lacks the entries in between): it reads on its own once
the read returns. A Redis error of the hub's read is handed to every reader waiting on it, which retries as it
would its own read (:mod:`producer.streams`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Final

import redis
import redis.asyncio

from gateway.cancelling import cancel_and_wait
from gateway.event_waits import set_within
from producer.streams import READ_COUNT, Entry, stream_entries

__all__ = ["BEHIND", "HUB_BLOCK_MS", "REJOIN_S", "StreamHub", "stream_id"]

log = logging.getLogger("fleet.api")

HUB_BLOCK_MS = 25
"""Longest wait of the hub's read (ms): the most a reader that comes back while a read is under way without
its stream waits for the next read (a stream's first read does not wait: it reads on its own meanwhile),
and how often the hub reads again while open streams get nothing."""
REJOIN_S = 0.005
"""How long the hub waits, after a read returned, for the readers it answered to come back (s)."""


def stream_id(entry_id: str | bytes) -> tuple[int, int]:
    """A stream entry ID (``"<ms>-<seq>"``) as a comparable pair."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


BEHIND: Final = None
"""What the hub hands a reader behind the others of its stream instead of entries: read on your own."""


class _Waiter:
    __slots__ = ("after", "future", "last_id")

    def __init__(self, last_id: str | bytes, future: asyncio.Future[list[Entry] | None]) -> None:
        self.last_id = last_id
        self.after = stream_id(last_id)
        self.future = future


class StreamHub:
    """Waits for the entries of every relayed stream with one ``XREAD`` (see the module docstring)."""

    def __init__(self, client: redis.asyncio.Redis[bytes], *, block_ms: int = HUB_BLOCK_MS) -> None:
        self.client = client
        self.block_ms = block_ms
        self._waiting: dict[str, list[_Waiter]] = {}
        self._in_read: dict[str, bool] = {}
        """The streams of the read under way."""
        self._reading = False
        """Whether a read of the hub is under way."""
        self._read_ends_s = 0.0
        """When the read under way ends at the latest (monotonic s)."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.reads = 0
        """Blocking reads the hub sent (not the readers' own joining reads)."""
        self.catch_ups = 0
        """Reads without blocking after a read answered one stream of several (:meth:`_catch_up`)."""
        self.behind_reads = 0
        """Reads of readers behind the others of their stream, made on their own (:meth:`_read_from`)."""

    async def xread(self, key: str, last_id: str | bytes, block_ms: int) -> list[Entry]:
        """The entries of stream ``key`` after ``last_id``, waiting up to ``block_ms`` ms for some; [] when
        none came. Raises what Redis raised (the readers retry :data:`producer.streams.RETRIED`)."""
        deadline_s = time.monotonic() + block_ms / 1000
        while True:
            left_ms = round((deadline_s - time.monotonic()) * 1000)
            if key in self._in_read or not self._reading or stream_id(last_id) != (0, 0):
                entries = await self._wait(key, last_id, max(1, left_ms))  # in the read under way, or the next
                if entries is not BEHIND:
                    return entries
                # behind another reader of its stream: its entries are there, so this read returns at once
                # (it blocks only where the stream lost them meanwhile: trimmed, expired)
                self.behind_reads += 1
                left_ms = round((deadline_s - time.monotonic()) * 1000)
                return stream_entries(await self.client.xread({key: last_id}, count=READ_COUNT, block=max(1, left_ms)))
            # a stream's first read while a read is under way without it: on its own until that read ends
            own_ms = max(1, min(left_ms, round((self._read_ends_s - time.monotonic()) * 1000)))
            entries = stream_entries(await self.client.xread({key: last_id}, count=READ_COUNT, block=own_ms))
            if entries or own_ms >= left_ms:
                self._start()  # it will wait again soon: the next read names it
                return entries

    def _start(self) -> None:
        """Start the hub's loop unless it runs."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="fleet-stream-hub")

    async def _wait(self, key: str, last_id: str | bytes, block_ms: int) -> list[Entry] | None:
        """The entries a read of the hub brought after ``last_id`` ([] at the bound), or :data:`BEHIND`."""
        waiter = _Waiter(last_id, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(key, []).append(waiter)
        self._start()
        self._wake.set()
        try:  # asyncio.wait, not wait_for: a cancel that meets the answer must still cancel (Python 3.11's
            # wait_for returns the result then, and the relay's task would read on after it was cancelled)
            await asyncio.wait({waiter.future}, timeout=block_ms / 1000)
            return waiter.future.result() if waiter.future.done() else []
        finally:
            waiters = self._waiting.get(key)
            if waiters is not None:
                with contextlib.suppress(ValueError):
                    waiters.remove(waiter)
                if not waiters:
                    del self._waiting[key]

    async def _loop(self) -> None:
        """Read while some reader waits; park when none does."""
        while True:
            if not self._waiting:
                self._wake.clear()
                if not await set_within(self._wake, 60.0):
                    return  # idle: the next reader starts the loop again
                continue
            streams = self._read_from()
            self._in_read = dict.fromkeys(streams, True)
            self._reading = True
            self._read_ends_s = time.monotonic() + self.block_ms / 1000
            self.reads += 1
            try:
                reply = await self.client.xread(streams, count=READ_COUNT, block=self.block_ms)
            except (redis.RedisError, OSError) as exc:
                self._fail(list(streams), exc)
                await asyncio.sleep(0.05)  # the readers retry on their own schedule; do not spin meanwhile
                continue
            finally:
                self._in_read, self._reading = {}, False
            answered = self._deliver(reply, streams)
            if len(answered) == 1 and len(streams) > 1:
                answered |= await self._catch_up(streams, answered)
            if answered:
                await self._rejoin(answered)

    def _read_from(self) -> dict[str, str | bytes]:
        """Where the next read starts in each waiting stream: the position of its readers furthest on. The
        readers behind them are handed :data:`BEHIND` (they read on their own, :meth:`xread`), so none waits
        while the read returns another reader's backlog, :data:`READ_COUNT` entries at a time."""
        streams: dict[str, str | bytes] = {}
        for key, waiters in self._waiting.items():
            head = max(waiters, key=lambda w: w.after)
            streams[key] = head.last_id
            for waiter in waiters:
                if waiter.after < head.after and not waiter.future.done():
                    waiter.future.set_result(BEHIND)
        return streams

    async def _catch_up(self, streams: dict[str, str | bytes], answered: set[str]) -> set[str]:
        """The other streams of a read that answered one: Redis before 7.0 answers a read blocked on several
        streams with the first that got entries only, though the worker wrote them all in one step. One
        read without blocking hands the others theirs (on Redis 7 it finds the streams that got none)."""
        rest = {key: streams[key] for key in streams if key not in answered and key in self._waiting}
        if not rest:
            return set()
        self.catch_ups += 1
        try:
            reply = await self.client.xread(rest, count=READ_COUNT)
        except (redis.RedisError, OSError):
            return set()  # the next blocking read finds them, or fails to their readers
        return self._deliver(reply, rest)

    def _deliver(self, reply: Any, read_from: dict[str, str | bytes]) -> set[str]:
        """Hand each waiting reader the entries after its position; returns the streams of those answered.

        ``read_from`` is where the read started in each stream. A reader that came in during the read with a
        position before that start (a stream's first read, a reader that fell behind the others of its
        stream) is not answered from it: the entries between its position and the start are not in the
        reply, and handing it the rest would skip them (its reader would see a gap and stop streaming until
        the request's result is stored). It is handed :data:`BEHIND`: it reads on its own."""
        answered: set[str] = set()
        for key, entries in _by_stream(reply).items():
            start = stream_id(read_from[key]) if key in read_from else None
            for waiter in self._waiting.get(key, ()):
                if start is None or waiter.future.done():
                    continue
                if waiter.after < start:
                    waiter.future.set_result(BEHIND)
                    continue
                mine = [e for e in entries if stream_id(e[0]) > waiter.after]
                if mine:
                    waiter.future.set_result(mine)
                    answered.add(key)
        return answered

    def _fail(self, keys: list[str], exc: BaseException) -> None:
        for key in keys:
            for waiter in self._waiting.get(key, ()):
                if not waiter.future.done():
                    waiter.future.set_exception(exc)

    async def _rejoin(self, answered: set[str]) -> None:
        """Give the readers just answered a moment (:data:`REJOIN_S`) to ask again, so the next read names them."""
        deadline = time.monotonic() + REJOIN_S
        while not all(any(not w.future.done() for w in self._waiting.get(key, ())) for key in answered):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                return
            self._wake.clear()
            await set_within(self._wake, left_s)

    async def aclose(self) -> None:
        """Stop the loop (readers waiting on it get [] at their own bound)."""
        if self._task is not None:
            await cancel_and_wait(self._task)


def _by_stream(reply: Any) -> dict[str, list[Entry]]:
    """An ``XREAD`` reply for several streams as ``{key: entries}`` (RESP2 or RESP3 forms)."""
    if not reply:
        return {}
    pairs = reply.items() if isinstance(reply, dict) else ((k, v) for k, v in reply)
    out: dict[str, list[Entry]] = {}
    for key, value in pairs:
        name = key.decode() if isinstance(key, bytes) else str(key)
        out[name] = stream_entries({key: value})
    return out
