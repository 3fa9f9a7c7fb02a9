"""The worker's stream publisher: token events to Redis Streams, cancel marks back to sequences.

The scheduler thread must never wait on Redis, so sequences hand their events to
:meth:`StreamPublisher.publish`, which only queues them. One publisher thread drains the queue and
writes every pending event in one pipeline (``XADD … MAXLEN ~`` plus ``EXPIRE`` per stream). In the
same loop it reads the cancel marks (``fleet:cancel:<id>``) of the generations this worker runs,
one ``MGET`` per ``cancel_poll_s``, and flags the cancelled ones; the scheduler ends them at its
next step. A second thread listens on the ``fleet:cancels`` channel, where cancels are also
published, so a cancel usually lands within one decode step; the poll catches any it missed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import redis

from protocol.errors import FleetError
from protocol.keys import CANCEL_CHANNEL, CANCEL_KEY, STREAM_KEY
from protocol.streams import StreamEvent, encode_event
from workers.generation.sequence import GenSequence

__all__ = ["StreamPublisher"]

log = logging.getLogger("fleet.streams")

_STOP = ("", None)


class StreamPublisher:
    """Publishes generation events and watches cancel marks (one thread per worker)."""

    def __init__(
        self,
        client: redis.Redis[bytes],
        *,
        ttl_s: int,
        max_len: int = 4096,
        cancel_poll_s: float = 0.02,
    ) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self.max_len = max_len
        self.cancel_poll_s = cancel_poll_s
        self._queue: queue.SimpleQueue[tuple[str, StreamEvent | None]] = queue.SimpleQueue()
        self._watched: dict[str, GenSequence] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="fleet-streams", daemon=True)
        self._listener = threading.Thread(target=self._listen, name="fleet-cancels", daemon=True)
        self._stopping = threading.Event()
        self.published = 0

    def start(self) -> None:
        """Start the publisher and cancel-listener threads."""
        self._thread.start()
        self._listener.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Publish what is queued, then stop."""
        self._stopping.set()
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        self._listener.join(timeout_s)

    def _flag(self, request_id: str) -> None:
        with self._lock:
            seq = self._watched.get(request_id)
        if seq is not None:
            seq.cancel_requested = True

    def _listen(self) -> None:
        """Flag watched sequences whose ID arrives on the cancel channel (reconnects on errors)."""
        while not self._stopping.is_set():
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(CANCEL_CHANNEL)
                try:
                    while not self._stopping.is_set():
                        message = pubsub.get_message(timeout=0.2)
                        if message and message.get("type") == "message":
                            data = message["data"]
                            self._flag(data.decode() if isinstance(data, bytes) else str(data))
                finally:
                    pubsub.close()
            except redis.RedisError as exc:
                log.warning("cancel listener: %s; retrying", exc)
                self._stopping.wait(1.0)

    def publish(self, request_id: str, event: StreamEvent) -> None:
        """Queue ``event`` for the stream of ``request_id`` (never blocks)."""
        self._queue.put((request_id, event))

    def watch(self, seq: GenSequence) -> None:
        """Check ``seq``'s cancel mark until :meth:`unwatch`."""
        with self._lock:
            self._watched[seq.request_id] = seq

    def unwatch(self, request_id: str) -> None:
        """Stop checking ``request_id``'s cancel mark."""
        with self._lock:
            self._watched.pop(request_id, None)

    def fail_if_generating(self, request_id: str, payload: Any, exc: BaseException) -> None:
        """End the stream of a failed request that asked to generate with an error event."""
        output = payload.get("output") if isinstance(payload, dict) else None
        wants_generation = isinstance(output, dict) and (
            output.get("kind") == "generate" or output.get("generation") is not None
        )
        if not wants_generation:
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
        while not stopping:
            batch: list[tuple[str, StreamEvent]] = []
            try:
                item = self._queue.get(timeout=self.cancel_poll_s)
                while True:
                    if item is _STOP or item[1] is None:
                        stopping = True
                    else:
                        batch.append((item[0], item[1]))
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass
            try:
                if batch:
                    self._write(batch)
                if time.monotonic() >= next_poll:
                    self._poll_cancels()
                    next_poll = time.monotonic() + self.cancel_poll_s
            except redis.RedisError as exc:  # Redis away: tokens still reach the stored result
                log.warning("stream publisher: %s (%d events dropped)", exc, len(batch))
                time.sleep(min(1.0, self.cancel_poll_s * 10))

    def _write(self, batch: list[tuple[str, StreamEvent]]) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            keys = set()
            for request_id, event in batch:
                key = STREAM_KEY.format(id=request_id)
                pipe.xadd(key, encode_event(event), maxlen=self.max_len, approximate=True)
                keys.add(key)
            for key in keys:
                pipe.expire(key, self.ttl_s)
            pipe.execute()
        self.published += len(batch)

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
