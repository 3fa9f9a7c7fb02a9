"""The worker's task events, gathered for ``celery.task_event_linger_ms`` and published from a thread of their own.

Celery sends three task events per request (task-received, task-started, task-succeeded: what
Flower shows). On the threads pool each is one kombu ``Producer.publish`` (one ``PUBLISH``) made
by the thread that handles the request, on the request's own path: ``fleet bench`` measured 0.9 ms
of a lone request's 4.8 ms and ~12 % of the worker's CPU under load going to them. Celery already
knows how to gather them: with an event loop (the prefork pool) its dispatcher buffers the ``task``
group and publishes the buffer as one ``task.multi`` message per loop turn, which Flower and every
``celery.events`` receiver read as the list of events it is. The threads pool has no loop, so Celery
publishes each event at once.

:class:`BufferedTaskEvents` is a consumer bootstep that turns that buffering on for the threads pool
and hands the publishing to :class:`EventFlusher`, a daemon thread that publishes what has gathered
``linger_s`` after the first event (one ``PUBLISH`` per flush, whatever the load). Each event keeps
the timestamp and clock of the moment it was sent; Flower sees it at most ``linger_s`` later.

Nothing is dropped that Celery would have kept: the buffer is published when the consumer stops
(warm shutdown) and, when Redis is unreachable, moved to the dispatcher's outbound buffer, which
Celery republishes once it has reconnected (``Events.start``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery, bootsteps
from celery.worker.consumer.events import Events

__all__ = ["BUFFER_LIMIT", "BufferedTaskEvents", "EventFlusher", "install", "uninstall"]

log = logging.getLogger(__name__)

BUFFER_LIMIT = 1000
"""Events the buffer may hold before the sending thread publishes it itself (Celery's default is 24,
which under load would put the publish back on a request's thread before the linger is over)."""


class EventFlusher:
    """Publishes a dispatcher's buffered ``task`` events ``linger_s`` after the first one arrives."""

    def __init__(self, linger_s: float) -> None:
        self.linger_s = linger_s
        self.dispatcher: Any = None
        self.flushes = 0
        """Flushes that found events to publish (a count for tests and debugging)."""
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-task-events", daemon=True)
        self._thread.start()

    def attach(self, dispatcher: Any) -> None:
        """Buffer ``dispatcher``'s ``task`` events and publish them from this thread."""
        dispatcher.buffer_group = frozenset({"task"})
        dispatcher.buffer_limit = BUFFER_LIMIT
        dispatcher.on_send_buffered = self._wake.set
        self.dispatcher = dispatcher

    def flush(self) -> None:
        """Publish what is buffered now (one ``task.multi`` message); on a Redis error it is kept."""
        dispatcher = self.dispatcher
        if dispatcher is None or not _buffered(dispatcher):
            return
        try:
            dispatcher.flush(errors=True, groups=True)  # a failed publish goes to the outbound buffer
            self.flushes += 1
        except Exception as exc:  # events never fail a request or kill the worker
            log.warning("task events not published: %s", exc)

    def detach(self) -> None:
        """Move the unsent events to the dispatcher's outbound buffer (the consumer stops or restarts).

        ``Events.start`` copies the outbound buffer to the next dispatcher and publishes it; at a
        warm shutdown :meth:`close` publishes it. No Redis command here: the connection may be the
        reason for the restart."""
        dispatcher = self.dispatcher
        if dispatcher is None:
            return
        with dispatcher.mutex:
            for group, events in dispatcher._group_buffer.items():
                batch = list(events)  # threads append without the mutex: take only what was copied
                if batch:
                    dispatcher._outbound_buffer.append((batch, f"{group}.multi"))
                    del events[: len(batch)]

    def close(self) -> None:
        """Publish what is left and stop the thread (warm shutdown)."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait()
            if self._stopped.wait(self.linger_s):
                return
            self._wake.clear()  # an event sent from here on wakes the next round
            self.flush()


def _buffered(dispatcher: Any) -> bool:
    return any(dispatcher._group_buffer.values()) or bool(dispatcher._outbound_buffer)


class BufferedTaskEvents(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: buffer the worker's task events and publish them via :class:`EventFlusher`.

    Runs after Celery's ``Events`` step, whose dispatcher it configures each time the consumer
    (re)connects. ``linger_s`` is set by :func:`install`; 0 or less leaves Celery's own behaviour."""

    requires = (Events,)
    linger_s = 0.0

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.flusher: EventFlusher | None = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        dispatcher = getattr(c, "event_dispatcher", None)
        if self.linger_s <= 0 or dispatcher is None or not dispatcher.enabled:
            return  # off (Celery's own behaviour), or events disabled
        if self.flusher is None:
            self.flusher = EventFlusher(self.linger_s)
        self.flusher.attach(dispatcher)

    def stop(self, c: Any) -> None:
        if self.flusher is not None:
            self.flusher.detach()

    def shutdown(self, c: Any) -> None:
        if self.flusher is not None:
            self.flusher.close()
            self.flusher = None


def install(app: Celery, linger_ms: float) -> None:
    """Add :class:`BufferedTaskEvents` to ``app``'s consumer, gathering events for ``linger_ms`` (0 = off)."""
    step = type("FleetBufferedTaskEvents", (BufferedTaskEvents,), {"linger_s": linger_ms / 1000.0})
    uninstall(app)
    app.steps["consumer"].add(step)


def uninstall(app: Celery) -> None:
    """Remove the step again (the bench's old worker path publishes each event at once, as before)."""
    for step in list(app.steps["consumer"]):
        if isinstance(step, type) and issubclass(step, BufferedTaskEvents):
            app.steps["consumer"].discard(step)
