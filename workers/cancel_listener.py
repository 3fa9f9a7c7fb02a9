"""The worker's cancel listening: cancel marks back to the generations it runs and the requests it holds.

A cancel sets the mark ``fleet:cancel:<id>`` and is published on the ``fleet:cancels`` channel.
:class:`CancelListener` learns of it two ways, so that a cancel usually lands within one decode step:

* its thread (``fleet-cancels``) listens on ``fleet:cancels`` (a ``get_message`` wait of
  :data:`~protocol.redis_conn.LISTEN_WAIT_S`, so a stop is seen within that; on a Redis error it
  reconnects 1 s later) and flags the watched generation with that ID (``cancel_requested``: the
  scheduler ends it at its next step). It hands every ID it hears to :attr:`CancelListener.waiting`
  (:mod:`workers.cancel_watch`), which ends a one-step request still
  waiting for its batch; once subscribed (at start, after a reconnect) it reads back the marks of those
  waiting, with one ``MGET``, for cancels published while it was not;
* :meth:`CancelListener.poll`, which the stream publisher's thread calls once per ``cancel_poll_s``
  (:mod:`workers.stream_publisher`), reads the marks of the generations watched and not yet flagged, with
  one ``MGET``, and catches any cancel the listener missed.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from protocol.keys import CANCEL_CHANNEL, CANCEL_KEY
from protocol.redis_conn import LISTEN_WAIT_S
from workers.cancel_watch import CancelWatch
from workers.generation.sequence import GenSequence
from workers.redis_outage import OutageLog

__all__ = ["CancelListener"]

log = logging.getLogger("fleet.streams")


class CancelListener:
    """Flags the watched generations and ends the waiting one-step requests whose cancel arrives (one
    listener thread per worker, beside the stream publisher's)."""

    def __init__(self, client: redis.Redis[bytes], *, ttl_s: int) -> None:
        """``client`` is the stream publisher's (redis-py retries off); ``ttl_s`` is how long a cancel mark
        lives (s)."""
        self.redis = client
        self._watched: dict[str, GenSequence] = {}
        self.waiting = CancelWatch(forget_after_s=ttl_s)
        """One-step requests waiting for their batch, ended by a cancel the listener hears (an ID heard is
        remembered ``ttl_s``, as long as its cancel mark lives)."""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._listen, name="fleet-cancels", daemon=True)
        self._stopping = threading.Event()

    def start(self) -> None:
        """Start the listener thread."""
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The listener thread (its death makes the worker not ready: :class:`workers.progress.ThreadWatch`)."""
        return self._thread

    def stop(self) -> None:
        """Ask the listener thread to stop (it ends at its next wait); returns at once."""
        self._stopping.set()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the listener thread to end."""
        self._thread.join(timeout_s)

    @property
    def watching(self) -> bool:
        """Whether any generation is watched (read without the lock: a stale answer costs one early or
        late poll)."""
        return bool(self._watched)

    def watch(self, seq: GenSequence) -> None:
        """Check ``seq``'s cancel mark until :meth:`unwatch`."""
        with self._lock:
            self._watched[seq.request_id] = seq

    def unwatch(self, request_id: str) -> None:
        """Stop checking ``request_id``'s cancel mark."""
        with self._lock:
            self._watched.pop(request_id, None)

    def flag(self, request_id: str) -> None:
        """Stop the watched generation ``request_id`` at its next step, or end the one-step request waiting for its
        batch, as a cancel heard on ``fleet:cancels`` does."""
        with self._lock:
            seq = self._watched.get(request_id)
        if seq is not None:
            seq.cancel_requested = True
        self.waiting.heard(request_id)

    def _listen(self) -> None:
        """Flag watched sequences and end waiting one-step requests whose ID arrives on the cancel channel
        (reconnects on errors)."""
        outage = OutageLog(log, "cancel listener lost Redis")
        while not self._stopping.is_set():
            try:
                pubsub = self.redis.pubsub()
                pubsub.subscribe(CANCEL_CHANNEL)
                outage.recovered(time.monotonic())
                try:
                    while not self._stopping.is_set():
                        message = pubsub.get_message(timeout=LISTEN_WAIT_S)
                        if not message:
                            continue
                        if message.get("type") == "message":
                            data = message["data"]
                            self.flag(data.decode() if isinstance(data, bytes) else str(data))
                        elif message.get("type") == "subscribe":  # every cancel is heard from now on: read
                            self._catch_up()  # back those published before
                finally:
                    pubsub.close()
            except redis.RedisError as exc:
                outage.failed(exc, time.monotonic())
                self._stopping.wait(1.0)

    def _catch_up(self) -> None:
        """End the waiting one-step requests whose cancel was published while the listener was not subscribed
        (the marks are set before they are announced). Nothing waits at start; after a reconnect, one ``MGET``."""
        ids = self.waiting.ids()
        if not ids:
            return
        marks = self.redis.mget([CANCEL_KEY.format(id=rid) for rid in ids])
        for rid, mark in zip(ids, marks, strict=True):
            if mark is not None:
                self.flag(rid)

    def poll(self) -> None:
        """Flag the watched generations whose cancel mark is set (one ``MGET``; none while each watched one
        is flagged or done).

        Raises:
            redis.RedisError: Redis did not answer.
        """
        with self._lock:
            watched = list(self._watched.values())
        live = [s for s in watched if not s.cancel_requested and not s.future.done()]
        if not live:
            return
        marks = self.redis.mget([CANCEL_KEY.format(id=s.request_id) for s in live])
        for seq, mark in zip(live, marks, strict=True):
            if mark is not None:
                seq.cancel_requested = True
