"""A request's cancel mark, read in the round trip that takes it off the queue.

A worker must not run a request that was cancelled while it waited (``FleetClient.cancel`` sets
``fleet:cancel:<id>``). It read the mark with one ``EXISTS`` per request from the task's thread: one
more round trip per request, which ``fleet bench`` with py-spy put at ~6 % of the worker's CPU on
the ``fleet.infer`` path. kombu already sends one pipeline per delivery as it takes a message
(``ZADD`` + ``HSET``, its unacked bookkeeping); :class:`CancelReadingQoS` adds the ``EXISTS`` to that
pipeline and leaves the answer in :data:`MARKS`, where :func:`workers.pipeline.handle_request` takes
it. Same commands, one round trip fewer, the same moment (the delivery precedes the task by well
under a millisecond). A request without a noted answer (taken by a channel without this QoS, or
the note evicted) is read with ``EXISTS`` as before.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from kombu.transport import virtual
from kombu.utils.json import dumps

from broker.batch_take import MARK_REPLY, WITH_MARK, add_take
from broker.kombu_channel import PlainPipelineQoS

__all__ = ["MARKS", "CancelMarks", "CancelReadingQoS", "task_id_of", "unacked_entry"]


class CancelMarks:
    """Cancel marks read at delivery, by task ID, until the task takes them (thread-safe).

    At most ``limit`` are kept (oldest dropped): a delivery Celery never runs (revoked, refused)
    leaves its note behind, and a dropped note only means one ``EXISTS``."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._marks: OrderedDict[str, bool] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, task_id: str, cancelled: bool) -> None:
        with self._lock:
            self._marks[task_id] = cancelled
            self._marks.move_to_end(task_id)
            while len(self._marks) > self.limit:
                self._marks.popitem(last=False)

    def take(self, task_id: str) -> bool | None:
        """Whether ``task_id`` was marked cancelled when it was taken; None when that was not read."""
        with self._lock:
            return self._marks.pop(task_id, None)

    def __len__(self) -> int:
        return len(self._marks)


MARKS = CancelMarks()
"""This worker process's marks (one process serves one model)."""


def task_id_of(message: Any) -> str | None:
    """The Celery task ID of a kombu message (protocol 2 header ``id``; protocol 1 correlation ID)."""
    headers = getattr(message, "headers", None) or {}
    task_id = headers.get("id") or (getattr(message, "properties", None) or {}).get("correlation_id")
    return str(task_id) if task_id else None


def unacked_entry(message: Any, delivery: dict[str, Any]) -> str:
    """kombu's unacked hash entry, ``[message, exchange, routing_key]`` as JSON, encoded as kombu does;
    what kombu restores from. A message the worker's channel took records it itself, with the list's
    bytes spliced in instead (:func:`broker.batch_take.unacked_entry_of`)."""
    return str(dumps([message._raw, delivery["exchange"], delivery["routing_key"]]))  # type: ignore[no-untyped-call]


class CancelReadingQoS(PlainPipelineQoS):
    """kombu's delivery bookkeeping (``ZADD`` + ``HSET``, one plain pipeline) plus the cancel mark's ``EXISTS``.

    A delivery its channel already recorded (``channel.pre_taken``: tag → the cancel mark read then,
    :mod:`broker.batch_take`) only gets kombu's in-memory record here."""

    marks = MARKS

    def append(self, message: Any, delivery_tag: Any) -> None:
        task_id = task_id_of(message)
        pre_taken: dict[str, bool | None] | None = getattr(self.channel, "pre_taken", None)
        if pre_taken is not None and delivery_tag in pre_taken:
            cancelled = pre_taken.pop(delivery_tag)
        else:
            with self.pipe_or_acquire() as pipe:
                entry = unacked_entry(message, message.delivery_info)
                count = add_take(pipe, self, delivery_tag, entry, task_id, time.time())
                replies = pipe.execute()
            cancelled = bool(replies[MARK_REPLY]) if count == WITH_MARK else None
        if task_id is not None and cancelled is not None:
            self.marks.note(task_id, cancelled)
        virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]  # kombu's in-memory record of the delivery

