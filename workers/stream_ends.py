"""A generation's stream ends after its result is stored: a reader that saw the end finds the result.

The scheduler thread makes a stream's last event (``final``, or ``error`` for a failed generation) the
moment the sequence ends; the task's thread then encodes the result and Celery stores it (one script
run, :mod:`broker.result_backend`). Written at once, the end reached readers before the result: a
client that read ``GET /v1/requests/<id>`` or ``FleetClient.status`` right after the stream ended saw
``running``.

So ``fleet.infer`` marks a generation's stream before it runs (:meth:`EndsAfterStore.hold`); the events
that end a marked stream wait here (:meth:`EndsAfterStore.keep`) until Celery's tracer is done with
the task, the result stored whatever the outcome (:func:`workers.trace_guard.on_traced`), and then go
to the stream publisher in the order they came (:meth:`EndsAfterStore.release`). Tokens are not held.

A trace that never ends (a killed worker) leaves the stream without its end, as a killed worker
always did: the redelivered request writes the stream again, and readers finish from the stored
result (:mod:`producer.streams`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from protocol.streams import StreamEvent

__all__ = ["MAX_HELD_STREAMS", "EndsAfterStore"]

MAX_HELD_STREAMS = 100_000
"""Most streams marked at once; past it the oldest mark is let go (its held events are published)."""


class EndsAfterStore:
    """The streams whose end waits for their stored result, and the ending events held (thread-safe)."""

    def __init__(self, limit: int = MAX_HELD_STREAMS) -> None:
        self.limit = max(1, limit)
        self._held: OrderedDict[str, list[StreamEvent]] = OrderedDict()
        self._lock = threading.Lock()

    def hold(self, request_id: str) -> list[tuple[str, list[StreamEvent]]]:
        """Hold the end of ``request_id``'s stream from now until :meth:`release`; returns the marks let
        go to stay within :attr:`limit` (each stream with its held events, to publish now)."""
        with self._lock:
            self._held.setdefault(request_id, [])
            let_go: list[tuple[str, list[StreamEvent]]] = []
            while len(self._held) > self.limit:
                let_go.append(self._held.popitem(last=False))
            return let_go

    def keep(self, request_id: str, event: StreamEvent) -> bool:
        """Keep ``event`` (a stream's last) until the stream is released; False when its stream is not
        held (publish it now)."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                return False
            held.append(event)
            return True

    def release(self, request_id: str) -> list[StreamEvent]:
        """The stream's result is stored: its held events, oldest first; the mark is gone."""
        with self._lock:
            return self._held.pop(request_id, [])

    def release_all(self) -> list[tuple[str, list[StreamEvent]]]:
        """Every held stream with its events (a stopping worker ends the streams it holds)."""
        with self._lock:
            held = list(self._held.items())
            self._held.clear()
            return held

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
