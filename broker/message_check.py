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
     task name, ``id`` a non-empty string, ``eta``/``expires`` ISO 8601 (``Request.__init__``),
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
``body[1]``, ``content-type``) and the rule, so the message's sender gets a FAILURE naming it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from kombu.utils.json import loads as _kombu_loads

from broker.eta_window import ETA_FIELD, eta_too_far, eta_unix_s
from protocol.deadletter import Reason
from protocol.keys import utf8_text
from protocol.messages import BULK_TASK_NAME, FLEET_TASK_PREFIX

__all__ = ["BODY_LAYOUT", "FLEET_TASK_PREFIX", "MAX_TASK_ID_CHARS", "Accepted", "Envelope", "Refused",
           "bulk_request_ids", "check_message", "parse_envelope"]

MAX_TASK_ID_CHARS = 256
"""Longest task ID accepted (Celery's are 36-character UUIDs; the fleet's request IDs at most 200)."""
BODY_LAYOUT = "[args: list, kwargs: object, embed: object]"
JSON_CONTENT_TYPE = "application/json"
PICKLE_CONTENT_TYPE = "application/x-python-serialize"
_UTF8 = frozenset({"utf-8", "utf8"})
_EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})
"""The fleet's own task names start with this; every other registered task (Celery's built-ins) is refused."""
_OPTIONAL_STR_HEADERS = (
    "lang", "shadow", "group", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "compression"
)
_OPTIONAL_INT_HEADERS = ("group_index", "retries", "replaced_task_nesting")


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


class _Bad(Exception):
    """Internal: one failed check (turned into :class:`Refused` with the envelope's ID)."""

    def __init__(self, reason: Reason, field: str, detail: str, limit: str) -> None:
        super().__init__(detail)
        self.reason, self.field, self.detail, self.limit = reason, field, detail, limit


def kombu_loads(data: bytes) -> Any:
    """kombu's JSON decoder (``__type__`` markers for datetime, bytes, decimal, uuid included)."""
    return _kombu_loads(data)  # type: ignore[no-untyped-call]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """A JSON-ish name for ``value``'s type, for messages."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    return "a number" if isinstance(value, int | float) else f"a {type(value).__name__}"


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
    except _Bad as bad:
        headers = doc.get("headers") if isinstance(doc, dict) else None
        task_id, task = _identity(headers)
        return Refused(bad.reason, bad.field, bad.detail, bad.limit, task_id, task)


def bulk_request_ids(item: bytes) -> list[str]:
    """The request IDs a ``fleet.infer_bulk`` queue item carries (``args[0].requests[*].request_id``,
    those a result can be stored under), so a dead-lettered bulk message fails each of its requests;
    ``[]`` for any other item or one that cannot be read. Never raises."""
    try:
        doc = kombu_loads(item)
        if not isinstance(doc, dict) or not isinstance(doc.get("headers"), dict):
            return []
        if doc["headers"].get("task") != BULK_TASK_NAME:
            return []
        args = kombu_loads(_body_bytes(doc))[0]
        requests = args[0]["requests"] if isinstance(args, list) and args and isinstance(args[0], dict) else []
    except Exception:  # an unreadable body fails the message under its task ID only
        return []
    if not isinstance(requests, list):
        return []
    ids = [r.get("request_id") for r in requests if isinstance(r, dict)]
    return list(dict.fromkeys(rid for rid in ids if isinstance(rid, str) and rid and utf8_text(rid)))


def _identity(headers: Any) -> tuple[str | None, str | None]:
    """The task ID and name in ``headers``, where they are usable strings (for the FAILURE result)."""
    if not isinstance(headers, dict):
        return None, None
    task_id, task = headers.get("id"), headers.get("task")
    good_id = isinstance(task_id, str) and 0 < len(task_id) <= MAX_TASK_ID_CHARS and utf8_text(task_id)
    return (task_id if good_id else None), (task if isinstance(task, str) and utf8_text(task) else None)



def _envelope(doc: Any) -> Envelope:
    limit = "a kombu envelope {body, headers, properties}"
    if not isinstance(doc, dict):
        raise _Bad(Reason.NOT_A_MESSAGE, "item", f"the queue item is {_kind(doc)}, not a kombu envelope", limit)
    for key, want, ok in (
        ("body", "a string", isinstance(doc.get("body"), str)),
        ("headers", "an object", isinstance(doc.get("headers"), dict)),
        ("properties", "an object", isinstance(doc.get("properties"), dict)),
    ):
        if not ok:
            got = "missing" if key not in doc else _kind(doc[key])
            raise _Bad(Reason.NOT_A_MESSAGE, key, f"{key} must be {want}; got {got}", limit)
    props: dict[str, Any] = doc["properties"]
    tag = props.get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        raise _Bad(Reason.NOT_A_MESSAGE, "properties.delivery_tag",
                   f"properties.delivery_tag must be a non-empty string; got {_kind(tag)}", limit)
    info = props.get("delivery_info")
    if not isinstance(info, dict):
        raise _Bad(Reason.NOT_A_MESSAGE, "properties.delivery_info",
                   f"properties.delivery_info must be an object; got {_kind(info)}", limit)
    for key in ("exchange", "routing_key"):
        if not isinstance(info.get(key), str):
            raise _Bad(Reason.NOT_A_MESSAGE, f"properties.delivery_info.{key}",
                       f"properties.delivery_info.{key} must be a string; got {_kind(info.get(key))}", limit)
    priority = props.get("priority")
    if priority is not None and not (_is_int(priority) and 0 <= priority <= 255):
        raise _Bad(Reason.NOT_A_MESSAGE, "properties.priority",
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
        _check_headers(headers, tasks)
        body = _check_body(_body_bytes(envelope.payload))
        if now_unix_s is not None and visibility_timeout_s is not None:
            too_far = eta_too_far(headers.get("eta"), now_unix_s=now_unix_s, visibility_timeout_s=visibility_timeout_s)
            if too_far is not None:  # refused last: a malformed message is named for what makes it so
                raise _Bad(Reason.ETA_BEYOND_VISIBILITY, ETA_FIELD, too_far.detail(), f"{too_far.limit_s:g}")
        return Accepted(body)
    except _Bad as bad:
        return Refused(bad.reason, bad.field, bad.detail, bad.limit, envelope.task_id, envelope.task)


def _check_headers(headers: dict[str, Any], tasks: Container[str] | None) -> None:
    task = _check_identity(headers)
    _check_header_types(headers)
    for key in ("eta", "expires"):
        _check_time(headers, key)
    _check_timelimit(headers.get("timelimit"))
    if tasks is not None and task not in tasks:
        raise _Bad(Reason.UNKNOWN_TASK, "headers.task", f"no task named {task!r}"[:300] + " is registered here",
                   "a registered task")
    if tasks is not None and not task.startswith(FLEET_TASK_PREFIX):
        raise _Bad(Reason.UNKNOWN_TASK, "headers.task", f"task {task!r}"[:300] + " is not one of the fleet's "
                   f"tasks: only {FLEET_TASK_PREFIX}* tasks run on its queues", f"a {FLEET_TASK_PREFIX}* task")


def _check_identity(headers: dict[str, Any]) -> str:
    """``task`` and ``id``: what the strategy and the result key need; returns the task name."""
    task = headers.get("task")
    if "task" not in headers:
        raise _Bad(Reason.BAD_HEADERS, "headers.task",
                   "headers.task is missing: not a Celery protocol 2 message (protocol 1 is not accepted)",
                   "Celery task protocol 2")
    if not isinstance(task, str) or not task:
        raise _Bad(Reason.BAD_HEADERS, "headers.task", f"headers.task must be a task name; got {_kind(task)}",
                   "a task name")
    task_id = headers.get("id")
    if not isinstance(task_id, str) or not 0 < len(task_id) <= MAX_TASK_ID_CHARS:
        got = f"{len(task_id)} characters" if isinstance(task_id, str) else _kind(task_id)
        raise _Bad(Reason.BAD_HEADERS, "headers.id",
                   f"headers.id must be a string of 1..{MAX_TASK_ID_CHARS} characters; got {got}",
                   f"1..{MAX_TASK_ID_CHARS} characters")
    field = "headers.id" if not utf8_text(task_id) else None if utf8_text(task) else "headers.task"
    if field is not None:
        raise _Bad(Reason.BAD_HEADERS, field, f"{field} holds a lone surrogate (a \\uD800-\\uDFFF escape): not "
                   "UTF-8 text, so no result could be stored under it", "UTF-8 text")
    return task


def _check_header_types(headers: dict[str, Any]) -> None:
    """The optional headers Celery reads, each of the type it assumes."""
    for key in _OPTIONAL_STR_HEADERS:
        if headers.get(key) is not None and not isinstance(headers[key], str):
            raise _Bad(Reason.BAD_HEADERS, f"headers.{key}",
                       f"headers.{key} must be a string or null; got {_kind(headers[key])}", "string or null")
    for key in _OPTIONAL_INT_HEADERS:
        if headers.get(key) is not None and not (_is_int(headers[key]) and headers[key] >= 0):
            raise _Bad(Reason.BAD_HEADERS, f"headers.{key}",
                       f"headers.{key} must be a non-negative integer or null; got {headers[key]!r}"[:300],
                       "integer >= 0 or null")
    stamped = headers.get("stamped_headers")
    if stamped is not None and not (isinstance(stamped, list) and all(isinstance(v, str) for v in stamped)):
        raise _Bad(Reason.BAD_HEADERS, "headers.stamped_headers",
                   f"headers.stamped_headers must be a list of strings or null; got {_kind(stamped)}",
                   "list of strings or null")
    if headers.get("stamps") is not None and not isinstance(headers["stamps"], dict):
        raise _Bad(Reason.BAD_HEADERS, "headers.stamps",
                   f"headers.stamps must be an object or null; got {_kind(headers['stamps'])}", "object or null")
    if headers.get("ignore_result") not in (None, False):  # the task would run and its answer be dropped
        raise _Bad(Reason.BAD_HEADERS, "headers.ignore_result",
                   f"headers.ignore_result must be false or null; got {headers['ignore_result']!r}"[:300] + ": the "
                   "fleet answers every request under its ID", "false or null")
    for key in sorted(_EMBED_KEYS & headers.keys()):
        if headers[key] is not None:  # Celery copies headers into the task's request context
            raise _Bad(Reason.BAD_HEADERS, f"headers.{key}", f"headers.{key} must not be set (it belongs in the "
                       "body's embed object)", "null")


def _check_time(headers: dict[str, Any], key: str) -> None:
    value = headers.get(key)
    if value is None:
        return
    if not isinstance(value, str):
        raise _Bad(Reason.BAD_HEADERS, f"headers.{key}",
                   f"headers.{key} must be an ISO 8601 string or null; got {_kind(value)}", "ISO 8601")
    try:
        eta_unix_s(value)  # read as Request.__init__ reads it ('' too: it parses to None there, then fails)
    except ValueError as exc:  # dateutil's OverflowError, … come wrapped: named by their own class
        why = type(exc.__cause__ or exc).__name__
        raise _Bad(Reason.BAD_HEADERS, f"headers.{key}",
                   f"headers.{key} is not an ISO 8601 time: {value!r}"[:300] + f" ({why})", "ISO 8601") from exc


def _check_timelimit(value: Any) -> None:
    if value is None:
        return
    ok = isinstance(value, list) and len(value) == 2 and all(
        v is None or (isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e9) for v in value
    )
    if not ok:
        raise _Bad(Reason.BAD_HEADERS, "headers.timelimit",
                   f"headers.timelimit must be [hard_s, soft_s] (numbers >= 0 or null); got {value!r}"[:300],
                   "[hard_s, soft_s]")


def _body_bytes(doc: dict[str, Any]) -> bytes:
    """The body as the bytes the deserializer would get, or why it cannot be read."""
    content_type = doc.get("content-type")
    if content_type == PICKLE_CONTENT_TYPE:
        raise _Bad(Reason.PICKLE, "content-type", f"content type {PICKLE_CONTENT_TYPE!r} (pickle) is disallowed: "
                   "this fleet accepts JSON only", JSON_CONTENT_TYPE)
    if content_type != JSON_CONTENT_TYPE:
        shown = repr(content_type)[:100] if isinstance(content_type, str) else _kind(content_type)
        raise _Bad(Reason.CONTENT_TYPE, "content-type",
                   f"content type {shown} is disallowed: this fleet accepts JSON only", JSON_CONTENT_TYPE)
    encoding = doc.get("content-encoding")
    if encoding is not None and (not isinstance(encoding, str) or encoding.lower() not in _UTF8):
        raise _Bad(Reason.BAD_ENCODING, "content-encoding",
                   f"content-encoding must be utf-8; got {encoding!r}"[:200], "utf-8")
    compression = doc["headers"].get("compression")
    if compression:
        raise _Bad(Reason.BAD_ENCODING, "headers.compression",
                   f"compressed bodies are not accepted (headers.compression={compression!r}); send JSON "
                   "uncompressed"[:300], "no compression")
    body_encoding = doc["properties"].get("body_encoding")
    body: str = doc["body"]
    if body_encoding == "base64":
        try:  # kombu's Base64 codec: not strict about stray characters, strict about padding
            return base64.b64decode(body.encode("utf-8"))
        except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
            raise _Bad(Reason.BAD_ENCODING, "body", f"body is not base64 ({exc})", "base64") from exc
    # kombu's decode_body: a falsy or 'utf-8' (any case) encoding leaves the text as is; any other
    # name is looked up as-is among its codecs, of which 'base64' is the only one
    if not body_encoding or (isinstance(body_encoding, str) and body_encoding.lower() == "utf-8"):
        try:
            return body.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _Bad(Reason.BAD_ENCODING, "body", f"body is not UTF-8 text ({exc})", "utf-8") from exc
    raise _Bad(Reason.BAD_ENCODING, "properties.body_encoding",
               f"properties.body_encoding must be base64 or utf-8; got {body_encoding!r}"[:200], "base64")


def _check_body(body: bytes) -> list[Any]:
    if not body:
        raise _Bad(Reason.BODY_NOT_JSON, "body", "body is empty", BODY_LAYOUT)
    try:
        decoded = kombu_loads(body)
    except Exception as exc:  # the same decoder Celery's json deserializer uses; hostile input raises anything
        raise _Bad(Reason.BODY_NOT_JSON, "body",
                   f"body is not JSON ({type(exc).__name__}: {exc})"[:500], BODY_LAYOUT) from exc
    if not isinstance(decoded, list) or len(decoded) != 3:
        shape = f"a list of {len(decoded)}" if isinstance(decoded, list) else _kind(decoded)
        raise _Bad(Reason.BAD_BODY, "body", f"body is {shape}; Celery protocol 2 needs {BODY_LAYOUT}", BODY_LAYOUT)
    args, kwargs, embed = decoded
    for i, (value, want, ok) in enumerate(
        ((args, "a list", isinstance(args, list)), (kwargs, "an object", isinstance(kwargs, dict)),
         (embed, "an object", isinstance(embed, dict)))
    ):
        if not ok:
            raise _Bad(Reason.BAD_BODY, f"body[{i}]", f"body[{i}] must be {want}; got {_kind(value)}", BODY_LAYOUT)
    _check_embed(embed)
    return decoded


def _check_embed(embed: dict[str, Any]) -> None:
    """Only the keys Celery writes, each null or empty: the fleet runs no callbacks, errbacks, chains or
    chords, and Celery acts on them outside the task body, where a bad one raised and left the message
    unacked (its worker slot taken for good)."""
    unknown = sorted(set(embed) - _EMBED_KEYS)
    if unknown:
        raise _Bad(Reason.BAD_BODY, f"body[2].{unknown[0]}"[:100],
                   f"body[2] may only hold {', '.join(sorted(_EMBED_KEYS))}; got {unknown[0]!r}"[:300],
                   "callbacks, chain, chord, errbacks")
    for key in sorted(_EMBED_KEYS & embed.keys()):
        value = embed[key]
        if value is None or (isinstance(value, list | dict) and not value):
            continue
        raise _Bad(Reason.BAD_BODY, f"body[2].{key}",
                   f"body[2].{key} must be null or empty; got {_kind(value)}"
                   f"{f' of {len(value)}' if isinstance(value, list | dict) else ''}: the fleet runs no "
                   "callbacks, errbacks, chains or chords (a request's outcome is its own result)", "null")
