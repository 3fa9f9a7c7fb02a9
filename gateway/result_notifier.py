"""Waking the gateway's waits the moment a result is stored: one pub/sub connection per process.

A worker stores every result with ``SET`` + ``PUBLISH`` on the result key's own channel (Celery's Redis
backend protocol, :mod:`workers.bulk` for bulk messages too). :class:`ResultNotifier` keeps one
``redis.asyncio`` pub/sub connection for the whole gateway: a wait subscribes its result keys' channels
(:meth:`ResultNotifier.watching`), waits for the server's confirmation, then reads the keys; a
publication on any of them sets the wait's event. The waits still read the keys themselves
(:func:`gateway.outcomes.await_outcomes`) on a slow backstop schedule, so a publication that is lost (a
Redis restart, a subscription not confirmed in time) delays an answer, never loses it.

One connection serves every waiting call: channels are subscribed while some wait needs them and
unsubscribed when the last one leaves, by a task of their own, so a wait answers without waiting for
that and the channels that several waits left in one turn go in one ``UNSUBSCRIBE``. A publication
carries the stored value itself (the worker publishes what it stores), so a woken wait reads it from
:attr:`Watch.published` instead of asking Redis again: one round trip fewer per answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis
import redis.asyncio

from gateway.cancelling import cancel_and_wait
from gateway.event_waits import all_set_within

__all__ = ["CONFIRM_S", "ResultNotifier", "Watch"]

log = logging.getLogger("fleet.api")

CONFIRM_S = 1.0
"""Longest wait for the server to confirm a subscription before the wait goes on without it (s)."""


class Watch:
    """One wait's view of its channels: ``event`` is set by each publication on one of them, and
    ``published`` holds the latest value published on each (result key → the stored meta, as bytes)."""

    __slots__ = ("event", "published")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.published: dict[bytes, bytes] = {}


class ResultNotifier:
    """Subscribes result channels for waiting coroutines and wakes them (see the module docstring)."""

    def __init__(self, client: redis.asyncio.Redis[bytes]) -> None:
        self.client = client
        self._pubsub: Any = None
        self._listener: asyncio.Task[None] | None = None
        self._waiters: dict[bytes, set[Watch]] = {}
        self._confirmed: dict[bytes, asyncio.Event] = {}
        # one command at a time: UNSUBSCRIBEs sent by several tasks at once were lost (redis-py 8.2)
        self._commands = asyncio.Lock()
        self._leaving: set[bytes] = set()
        """Channels whose last wait ended, not yet unsubscribed (:meth:`_unsubscribe_left`)."""
        self._unsubscriber: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def watching(self, keys: Sequence[bytes]) -> AsyncIterator[Watch]:
        """A :class:`Watch` woken whenever a result is published on one of ``keys`` (result keys, as
        channels), subscribed (and confirmed, or :data:`CONFIRM_S` passed) before it is yielded: read the
        keys after entering, and a result stored from then on wakes it, its value in ``published``."""
        watch = Watch()
        fresh = [k for k in dict.fromkeys(keys) if k not in self._waiters]
        for key in keys:
            self._waiters.setdefault(key, set()).add(watch)
        try:
            if fresh:
                await self._subscribe(fresh)
            yield watch
        finally:
            left = []
            for key in keys:
                waiting = self._waiters.get(key)
                if waiting is not None:
                    waiting.discard(watch)
                    if not waiting:
                        del self._waiters[key]
                        left.append(key)
            if self._pubsub is not None:  # subscribed (or tried): unsubscribed by a task of their own
                self._leave(left)

    def _leave(self, keys: Sequence[bytes]) -> None:
        """Have ``keys`` unsubscribed (:meth:`_unsubscribe_left`) unless a wait wants them again by then."""
        self._leaving.update(keys)
        if self._leaving and (self._unsubscriber is None or self._unsubscriber.done()):
            self._unsubscriber = asyncio.create_task(self._unsubscribe_left(), name="fleet-result-unsubscribe")

    async def _unsubscribe_left(self) -> None:
        """Unsubscribe, in one command per turn, the channels no wait needs any more: a wait that ends answers
        its caller without waiting for that, and channels left together go together. A channel wanted
        again meanwhile stays subscribed (its new wait subscribed it again, after this if it comes later:
        the commands are sent in order under one lock)."""
        while self._leaving:
            await asyncio.sleep(0)  # let the waits ending in this turn of the loop add theirs
            async with self._commands:
                gone = [key for key in self._leaving if key not in self._waiters]
                self._leaving.clear()
                if gone:
                    # lost with a broken connection, they are subscribed again when it reconnects (redis-py
                    # subscribes every channel it has not seen unsubscribed): _listen leaves them again then
                    with contextlib.suppress(redis.RedisError, OSError):
                        await self._pubsub.unsubscribe(*gone)

    async def _subscribe(self, keys: list[bytes]) -> None:
        confirmations = [asyncio.Event() for _ in keys]  # fresh: an earlier subscription's may still be set
        self._confirmed.update(zip(keys, confirmations, strict=True))
        try:
            async with self._commands:
                if self._pubsub is None:
                    self._pubsub = self.client.pubsub()
                await self._pubsub.subscribe(*keys)
        except (redis.RedisError, OSError) as exc:  # the backstop reads still answer the wait
            log.warning("result notifications unavailable (%s): waits fall back to reading", exc)
            return
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen(), name="fleet-result-notifier")
        await all_set_within(confirmations, CONFIRM_S)  # unconfirmed: the wait goes on, its backstop reads

    async def _listen(self) -> None:
        """Read the pub/sub connection for as long as the process lives; wake the waiters of each message."""
        broken = False
        while True:
            try:
                message = await self._pubsub.get_message(ignore_subscribe_messages=False, timeout=1.0)
            except (redis.RedisError, OSError) as exc:
                if not broken:  # once per outage, not every retry
                    log.warning("result notifications interrupted (%s): waits read their keys until it is back", exc)
                broken = True
                for confirmed in self._confirmed.values():
                    confirmed.clear()
                await asyncio.sleep(0.2)
                continue
            if broken:
                log.info("result notifications are back")
                broken = False
            if message is None:
                continue
            channel = message.get("channel")
            kind = message.get("type")
            if kind == "message":
                for watch in self._waiters.get(channel, ()):
                    watch.published[channel] = message["data"]
                    watch.event.set()
            elif kind == "subscribe" and channel in self._waiters:
                self._confirmed.setdefault(channel, asyncio.Event()).set()
            elif kind == "subscribe":  # no wait needs it: an UNSUBSCRIBE lost in an outage, the reconnection
                self._confirmed.pop(channel, None)  # subscribed it again; without this it stayed for good
                self._leave([channel])
            elif kind == "unsubscribe" and channel not in self._waiters:  # not wanted again meanwhile
                self._confirmed.pop(channel, None)

    async def aclose(self) -> None:
        """Stop listening and close the connection."""
        if self._unsubscriber is not None:
            await cancel_and_wait(self._unsubscriber)
        if self._listener is not None:
            await cancel_and_wait(self._listener)
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
