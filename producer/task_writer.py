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

The owners of the requests a message names, where the gateway set them for the calls it makes
(:func:`owners_in_messages`), travel in its ``fleet_owners`` header (:data:`protocol.keys.OWNERS_HEADER`,
``{request_id: owner}``): a worker's result store writes an owner mark back where Redis lost it. Where tasks are
not written here, the client passes the same header to ``send_task`` (:func:`owners_header`; Celery adds a
``headers=`` option's entries to the message's headers, which the worker gives as the task request's attributes).
A message without it (every other client) has no owner; workers need nothing of it.
"""

from __future__ import annotations

import base64
import os
import threading
import uuid
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import redis
from celery import Celery
from celery.events import Event
from celery.utils.nodenames import anon_nodename
from celery.utils.time import utcoffset
from kombu.utils.json import dumps

from protocol.keys import OWNERS_HEADER

__all__ = ["TaskMessage", "TaskWriter", "call_owners", "owners_header", "owners_in_messages"]

_EVENT_TYPE = "task-sent"
_BODY_ENCODING = "base64"
_CONTENT_TYPE = "application/json"
_CONTENT_ENCODING = "utf-8"
_PERSISTENT = 2
"""kombu's delivery mode of a task (persistent); events are transient (1)."""
_TRANSIENT = 1


_MESSAGE_OWNERS: ContextVar[Mapping[str, str] | None] = ContextVar("fleet_message_owners", default=None)
"""Request ID -> owner, for the messages this context builds (:func:`owners_in_messages`)."""


_CLAIMED_NOW: ContextVar[frozenset[str]] = ContextVar("fleet_marks_claimed_now", default=frozenset())
"""The request IDs whose owner marks the caller claimed for this call (:func:`owners_in_messages`)."""


@contextmanager
def owners_in_messages(owners: Mapping[str, str], claimed_now: Collection[str] = ()) -> Iterator[None]:
    """Within the block, a message :meth:`TaskWriter.build` makes for a request of ``owners`` (request ID -> owner
    mark, :mod:`gateway.request_owners`) carries its owner in its ``fleet_owners`` header, and the queue step
    (:mod:`producer.idempotent_queue`) records in the submit marker of each request it queues whether it has an
    owner, and deletes the mark of an ID of ``claimed_now`` (marks this call claimed) that it finds queued by a
    caller without an owner."""
    token = _MESSAGE_OWNERS.set({**(_MESSAGE_OWNERS.get() or {}), **owners})
    claimed = _CLAIMED_NOW.set(_CLAIMED_NOW.get() | frozenset(claimed_now))
    try:
        yield
    finally:
        _CLAIMED_NOW.reset(claimed)
        _MESSAGE_OWNERS.reset(token)


def call_owners() -> tuple[Mapping[str, str], frozenset[str]]:
    """The owners set for this call (:func:`owners_in_messages`) and the IDs whose marks it claimed now."""
    return _MESSAGE_OWNERS.get() or {}, _CLAIMED_NOW.get()


def _owners_named(task_id: str, args: list[Any]) -> dict[str, str]:
    """The owners (:func:`owners_in_messages`) of the requests a message names: its task ID (``fleet.infer``) and
    each ``request_id`` of a ``fleet.infer_bulk`` body's ``requests``."""
    owners = _MESSAGE_OWNERS.get()
    if not owners:
        return {}
    items = args[0].get("requests") if args and isinstance(args[0], dict) else None
    named: list[Any] = [task_id]
    if isinstance(items, list):
        named += [item.get("request_id") for item in items if isinstance(item, dict)]
    return {rid: owners[rid] for rid in named if isinstance(rid, str) and rid in owners}


def owners_header(task_id: str, args: list[Any]) -> dict[str, Any]:
    """The headers a task message of ``task_id`` and ``args`` adds for its requests' owners (within
    :func:`owners_in_messages`): ``{"fleet_owners": {request_id: owner}}``, or ``{}`` when it names none."""
    owners = _owners_named(task_id, args)
    return {OWNERS_HEADER: owners} if owners else {}


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
        headers = {**headers, **owners_header(task_id, args)}
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
