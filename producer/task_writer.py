"""Queue a ``fleet.infer`` task with one Redis round trip: Celery's message, kombu's envelope, one pipeline.

``Celery.send_task`` spends most of a producer's CPU on the ``fleet.infer`` path (``fleet bench``
with py-spy: 53 % of the producer's samples): option merging and routing, a kombu ``Producer``
acquired from a pool, ``Connection.ensure``, a queue declaration check, then a second full
``Producer.publish`` for the ``task-sent`` event that Flower reads. :class:`TaskWriter` writes the
same two things in one pipeline, ``LPUSH`` of the task and ``PUBLISH`` of its event, built by the
same code Celery and kombu use:

* the task message (headers, properties, body) by ``app.amqp.as_task_v2``, exactly as
  ``send_task`` calls it (same ``reply_to``, ``origin``, ``root_id``, sent event);
* the event channel's name by a kombu Redis channel of the app's own broker connection
  (``_get_publish_topic``: its database prefix and fanout options); a task of priority 0 goes to
  the list named as its queue, as kombu's ``_q_for_pri`` says (checked once);
* the event by ``celery.events.Event`` with the app's Lamport clock, the fields
  ``EventDispatcher`` adds (hostname, utcoffset, pid, clock) and the queue it was routed to.

The envelope is kombu's Redis envelope (JSON, body base64, ``delivery_info``, a fresh
``delivery_tag``), which workers, ``celery inspect`` and Flower read as any other task.
``tests/integration/test_task_writer.py`` compares it field by field with what ``send_task`` writes.

It serves the plain Redis transport: with a ``global_keyprefix`` or a non-Redis broker,
:meth:`TaskWriter.usable` is False and the client keeps using ``send_task``.
"""

from __future__ import annotations

import base64
import os
import threading
import uuid
from typing import Any, NamedTuple

import redis
from celery import Celery
from celery.events import Event
from celery.utils.nodenames import anon_nodename
from celery.utils.time import utcoffset
from kombu.utils.json import dumps

__all__ = ["TaskMessage", "TaskWriter"]

_EVENT_TYPE = "task-sent"
_BODY_ENCODING = "base64"
_CONTENT_TYPE = "application/json"
_CONTENT_ENCODING = "utf-8"
_PERSISTENT = 2
"""kombu's delivery mode of a task (persistent); events are transient (1)."""
_TRANSIENT = 1


def _envelope(body: Any, headers: dict[str, Any], properties: dict[str, Any], exchange: str,
              routing_key: str, delivery_mode: int) -> str:  # fmt: skip
    """kombu's Redis envelope of one message (``Channel.prepare_message`` + ``basic_publish``), as JSON."""
    encoded = base64.b64encode(dumps(body).encode(_CONTENT_ENCODING)).decode("ascii")  # type: ignore[no-untyped-call]
    return str(
        dumps(  # type: ignore[no-untyped-call]
            {
                "body": encoded,
                "content-encoding": _CONTENT_ENCODING,
                "content-type": _CONTENT_TYPE,
                "headers": headers,
                "properties": {
                    **properties,
                    "delivery_mode": delivery_mode,
                    "delivery_info": {"exchange": exchange, "routing_key": routing_key},
                    "priority": 0,
                    "body_encoding": _BODY_ENCODING,
                    "delivery_tag": str(uuid.uuid4()),
                },
            }
        )
    )


class TaskMessage(NamedTuple):
    """One task as Redis gets it: ``LPUSH queue envelope``, then ``PUBLISH channel event`` unless event is ""."""

    queue: str
    envelope: str
    channel: str
    event: str


class TaskWriter:
    """Writes tasks of ``app`` to the Redis of ``client`` (the same server as the app's broker)."""

    def __init__(self, app: Celery, client: redis.Redis[bytes]) -> None:
        self.app = app
        self.client = client
        self._lock = threading.Lock()
        self._topic = ""
        self._usable: bool | None = None
        self._hostname = ""

    def usable(self) -> bool:
        """Whether tasks can be written this way (plain Redis transport, no key prefix); checked once."""
        if self._usable is None:
            with self._lock:
                if self._usable is None:
                    self._usable = self._learn_names()
        return bool(self._usable)

    def _learn_names(self) -> bool:
        """Check a kombu channel of the app's broker puts priority-0 tasks on the queue's own list, and take
        the task-sent event's channel name from it."""
        from kombu.transport import redis as kombu_redis

        options = self.app.conf.broker_transport_options or {}
        if options.get("global_keyprefix"):
            return False
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            if not isinstance(channel, kombu_redis.Channel) or channel._q_for_pri("q", 0) != "q":  # type: ignore[no-untyped-call]
                return False
            topic = channel._get_publish_topic(  # type: ignore[no-untyped-call]
                self.app.conf.event_exchange, _EVENT_TYPE.replace("-", "."))
        self._topic = str(topic)
        self._hostname = anon_nodename()
        return True

    def build(self, name: str, task_id: str, queue: str, args: list[Any], *, argsrepr: str | None,
              kwargsrepr: str) -> TaskMessage:  # fmt: skip
        """The task's envelope for ``queue`` and (``task_send_sent_event``) its task-sent event, unwritten.

        ``argsrepr`` None lets Celery write its own (a bounded ``saferepr`` of ``args``).
        """
        assert self._usable, "call usable() first"
        conf = self.app.conf
        headers, properties, body, sent_event = self.app.amqp.as_task_v2(
            task_id, name, args=args, kwargs={}, reply_to=self.app.thread_oid,
            create_sent_event=conf.task_send_sent_event, root_id=task_id, origin=self._hostname, ignore_result=None,
            argsrepr=argsrepr, kwargsrepr=kwargsrepr,
        )  # fmt: skip
        event = ""
        if sent_event:
            sent = Event(
                _EVENT_TYPE, hostname=self._hostname, utcoffset=utcoffset(), pid=os.getpid(),
                clock=self.app.clock.forward(), **sent_event, queue=queue, exchange="", routing_key=queue,
            )  # fmt: skip
            event = _envelope(sent, {"hostname": self._hostname}, {}, conf.event_exchange,
                              _EVENT_TYPE.replace("-", "."), _TRANSIENT)  # fmt: skip
        envelope = _envelope(body, headers, properties, "", queue, _PERSISTENT)
        return TaskMessage(queue=queue, envelope=envelope, channel=self._topic, event=event)

    def send(self, name: str, task_id: str, queue: str, args: list[Any], *, argsrepr: str, kwargsrepr: str) -> None:
        """``LPUSH`` the task to ``queue`` and (``task_send_sent_event``) ``PUBLISH`` its task-sent event.

        Raises:
            redis.RedisError: the pipeline failed (nothing, or the task alone, was written).
        """
        message = self.build(name, task_id, queue, args, argsrepr=argsrepr, kwargsrepr=kwargsrepr)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.lpush(message.queue, message.envelope)
            if message.event:
                pipe.publish(message.channel, message.event)
            pipe.execute()
