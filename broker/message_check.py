"""What a queue item must look like before kombu and Celery touch it (pure: bytes in, verdict out).

kombu's Redis transport and Celery's task strategy decode a popped item in steps, and an
exception in most of them escapes into the worker's event loop, which stops the worker; Celery
drops (with a log line) what it does catch. This module runs the same steps on the raw bytes
first, with the same decoders, and says either "deliver it" or why not:

1. :func:`parse_envelope` — the item is JSON (kombu's ``loads``, with its ``__type__`` markers)
   and a kombu envelope: ``body`` a string; ``headers`` an object; ``properties`` with a string
   ``delivery_tag`` (the unacked hash's key), ``delivery_info.exchange``/``routing_key`` strings
   (used to restore it), an integer ``priority``. This is all the guard needs to count deliveries.
2. :func:`check_message` — the rest, in the order Celery meets it:

   * headers of Celery protocol 2 (``celery/app/amqp.py`` ``as_task_v2``): ``task`` a registered
     task name, ``id`` a request ID (:data:`~protocol.keys.REQUEST_ID_PATTERN`: it names the result's key),
     ``eta``/``expires`` ISO 8601 (``Request.__init__``),
     ``timelimit`` ``[hard, soft]``, ``retries`` an integer, the ``*repr``/``*_id`` fields strings,
     ``ignore_result`` false or null (true ran the request and stored no answer: no trace at all);
     protocol 1 (no ``task`` header) is refused;
   * ``content-type`` ``application/json`` (``accept_content``; kombu would hand the bytes of the
     "trusted" ``application/data`` and ``application/text`` to Celery undecoded);
     ``content-encoding`` UTF-8; ``body_encoding`` ``base64`` or UTF-8; no ``compression``;
   * the body decodes as JSON into ``[args (list), kwargs (object), embed (object)]``
     (``celery/worker/request.py`` unpacks it in the event loop), with ``embed`` holding only
     ``callbacks``/``errbacks``/``chain``/``chord``, each null or empty: ``celery/app/trace.py``
     writes them into the task's request context and Celery's success and failure handlers act on
     them outside the task body, where a signature they cannot read (``{"x": 1}``) raised and left
     the message unacked and its slot taken. The fleet's producer and a plain ``send_task`` write
     them null; a request's outcome is its own result, so canvas links are refused;
   * the task is one of the fleet's own (registered, named ``fleet.*``): Celery's built-in tasks
     (``celery.chunks``, ``celery.backend_cleanup``, ``celery.chord_unlock``, …) are registered in
     every worker but are not the fleet's to run;
   * last, given the time and the visibility timeout, an ``eta`` at most
     :func:`broker.eta_window.max_eta_ahead_s` ahead: a message held for its ETA longer than the
     visibility timeout is handed to another worker by the Redis broker and runs twice.

Each refusal carries a :class:`protocol.deadletter.Reason`, the field that broke (``headers.id``,
``body[1]``, ``content-type``) and the rule, so the message's sender gets a FAILURE naming it. Step 2's
rules themselves (headers, content type and encodings, body) are in :mod:`broker.message_fields`.
"""

from __future__ import annotations

import re
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from broker.eta_window import ETA_FIELD, eta_too_far
from broker.message_fields import (
    BODY_LAYOUT,
    MAX_TASK_ID_CHARS,
    BadField,
    body_bytes,
    check_body,
    check_headers,
    is_int,
    json_kind,
    kombu_loads,
)
from protocol.deadletter import Reason
from protocol.keys import REQUEST_ID_PATTERN, utf8_text
from protocol.messages import BULK_TASK_NAME, FLEET_TASK_PREFIX

__all__ = ["BODY_LAYOUT", "FLEET_TASK_PREFIX", "MAX_TASK_ID_CHARS", "Accepted", "Envelope", "Refused",
           "bulk_request_ids", "check_message", "parse_envelope"]


@dataclass(frozen=True)
class Envelope:
    """A queue item that is a kombu envelope: what kombu delivers, and what the guard reads off it."""

    payload: dict[str, Any]
    task_id: str | None
    task: str | None
    redelivered: bool


@dataclass(frozen=True)
class Refused:
    """Why an item must not be delivered: the reason, the field that broke, the rule, in words (and, for
    ``max_deliveries``, the deliveries counted)."""

    reason: Reason
    field: str
    detail: str
    limit: str
    task_id: str | None = None
    task: str | None = None
    deliveries: int | None = None


@dataclass(frozen=True)
class Accepted:
    """A message Celery can take, with its body decoded as Celery would decode it (``[args, kwargs, embed]``)."""

    body: list[Any]


def parse_envelope(item: bytes) -> Envelope | Refused:
    """Step 1: decode the list item as kombu would and check the envelope's shape.

    Never raises: anything kombu's decoder raises (``ValueError``, ``RecursionError`` on deep
    nesting, ``ArithmeticError`` from a bad ``decimal`` marker, …) is a refusal.
    """
    try:
        doc = kombu_loads(item)
    except Exception as exc:  # kombu's decoder can raise nearly anything on hostile input
        return Refused(Reason.NOT_JSON, "item", f"the queue item is not JSON ({type(exc).__name__}: {exc})"[:500],
                       "a JSON kombu envelope")
    try:
        return _envelope(doc)
    except BadField as bad:
        headers = doc.get("headers") if isinstance(doc, dict) else None
        task_id, task = _identity(headers)
        return Refused(bad.reason, bad.field, bad.detail, bad.limit, task_id, task)


def bulk_request_ids(item: bytes) -> list[str]:
    """The request IDs a ``fleet.infer_bulk`` queue item carries (``args[0].requests[*].request_id``,
    those a result can be stored under: :data:`~protocol.keys.REQUEST_ID_PATTERN`), so a dead-lettered bulk
    message fails each of its requests;
    ``[]`` for any other item or one that cannot be read. Never raises."""
    try:
        doc = kombu_loads(item)
        if not isinstance(doc, dict) or not isinstance(doc.get("headers"), dict):
            return []
        if doc["headers"].get("task") != BULK_TASK_NAME:
            return []
        args = kombu_loads(body_bytes(doc))[0]
        requests = args[0]["requests"] if isinstance(args, list) and args and isinstance(args[0], dict) else []
    except Exception:  # an unreadable body fails the message under its task ID only
        return []
    if not isinstance(requests, list):
        return []
    ids = [r.get("request_id") for r in requests if isinstance(r, dict)]
    return list(dict.fromkeys(rid for rid in ids if isinstance(rid, str) and re.fullmatch(REQUEST_ID_PATTERN, rid)))


def _identity(headers: Any) -> tuple[str | None, str | None]:
    """The task ID and name in ``headers``, where they are usable strings (the ID one a FAILURE result can be
    stored under, :data:`~protocol.keys.REQUEST_ID_PATTERN`: none is stored under a key no client can poll)."""
    if not isinstance(headers, dict):
        return None, None
    task_id, task = headers.get("id"), headers.get("task")
    good_id = isinstance(task_id, str) and re.fullmatch(REQUEST_ID_PATTERN, task_id) is not None
    return (task_id if good_id else None), (task if isinstance(task, str) and utf8_text(task) else None)


def _envelope(doc: Any) -> Envelope:
    limit = "a kombu envelope {body, headers, properties}"
    if not isinstance(doc, dict):
        raise BadField(Reason.NOT_A_MESSAGE, "item", f"the queue item is {json_kind(doc)}, not a kombu envelope", limit)
    for key, want, ok in (
        ("body", "a string", isinstance(doc.get("body"), str)),
        ("headers", "an object", isinstance(doc.get("headers"), dict)),
        ("properties", "an object", isinstance(doc.get("properties"), dict)),
    ):
        if not ok:
            got = "missing" if key not in doc else json_kind(doc[key])
            raise BadField(Reason.NOT_A_MESSAGE, key, f"{key} must be {want}; got {got}", limit)
    props: dict[str, Any] = doc["properties"]
    tag = props.get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        raise BadField(Reason.NOT_A_MESSAGE, "properties.delivery_tag",
                       f"properties.delivery_tag must be a non-empty string; got {json_kind(tag)}", limit)
    info = props.get("delivery_info")
    if not isinstance(info, dict):
        raise BadField(Reason.NOT_A_MESSAGE, "properties.delivery_info",
                       f"properties.delivery_info must be an object; got {json_kind(info)}", limit)
    for key in ("exchange", "routing_key"):
        if not isinstance(info.get(key), str):
            raise BadField(Reason.NOT_A_MESSAGE, f"properties.delivery_info.{key}",
                           f"properties.delivery_info.{key} must be a string; got {json_kind(info.get(key))}", limit)
    priority = props.get("priority")
    if priority is not None and not (is_int(priority) and 0 <= priority <= 255):
        raise BadField(Reason.NOT_A_MESSAGE, "properties.priority",
                       f"properties.priority must be an integer 0..255 or null; got {priority!r}"[:300], "0..255")
    headers: dict[str, Any] = doc["headers"]
    task_id, task = _identity(headers)
    redelivered = headers.get("redelivered") is True or info.get("redelivered") is True
    return Envelope(doc, task_id, task, redelivered)


def check_message(envelope: Envelope, tasks: Container[str] | None, *, now_unix_s: float | None = None,
                  visibility_timeout_s: float | None = None) -> Refused | Accepted:
    """Step 2: headers, content type and encodings, body layout, then how far ahead its ETA is.

    Args:
        envelope: what :func:`parse_envelope` accepted.
        tasks: the registered task names (``app.tasks``); None skips the name check.
        now_unix_s: the time (wall clock, Unix s), and
        visibility_timeout_s: the broker's visibility timeout (s): with both, an ``eta`` further ahead than
            :func:`~broker.eta_window.max_eta_ahead_s` is refused; either None skips that check.
    """
    try:
        headers = envelope.payload["headers"]
        check_headers(headers, tasks)
        body = check_body(body_bytes(envelope.payload))
        if now_unix_s is not None and visibility_timeout_s is not None:
            too_far = eta_too_far(headers.get("eta"), now_unix_s=now_unix_s, visibility_timeout_s=visibility_timeout_s)
            if too_far is not None:  # refused last: a malformed message is named for what makes it so
                raise BadField(Reason.ETA_BEYOND_VISIBILITY, ETA_FIELD, too_far.detail(), f"{too_far.limit_s:g}")
        return Accepted(body)
    except BadField as bad:
        return Refused(bad.reason, bad.field, bad.detail, bad.limit, envelope.task_id, envelope.task)
