"""The field rules of a Celery protocol 2 task message, each as kombu or Celery reads the field.

Pure: each rule takes the decoded envelope's parts and raises :class:`BadField` (the
:class:`protocol.deadletter.Reason`, the field that broke, the rule) at the first field that breaks it.
:mod:`broker.message_check` runs them in the order Celery meets the fields and turns a :class:`BadField`
into its ``Refused`` verdict; its module docstring lists the rules, with the Celery code each one mirrors.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Container
from typing import Any

from kombu.utils.json import loads as _kombu_loads

from broker.eta_window import eta_unix_s
from protocol.deadletter import Reason
from protocol.keys import REQUEST_ID_PATTERN, REQUEST_ID_RULE, utf8_text
from protocol.messages import FLEET_TASK_PREFIX

__all__ = ["BODY_LAYOUT", "MAX_TASK_ID_CHARS", "BadField", "body_bytes", "check_body", "check_headers", "is_int",
           "json_kind", "kombu_loads"]

MAX_TASK_ID_CHARS = 128
"""Longest task ID accepted: a fleet task's ID is its request's, held to :data:`~protocol.keys.REQUEST_ID_PATTERN`
(Celery's own are 36-character UUIDs)."""
BODY_LAYOUT = "[args: list, kwargs: object, embed: object]"
JSON_CONTENT_TYPE = "application/json"
PICKLE_CONTENT_TYPE = "application/x-python-serialize"
_UTF8 = frozenset({"utf-8", "utf8"})
_EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})
"""The keys of a body's embed object that Celery writes and reads (it copies them from headers too)."""
_OPTIONAL_STR_HEADERS = (
    "lang", "shadow", "group", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "compression"
)
_OPTIONAL_INT_HEADERS = ("group_index", "retries", "replaced_task_nesting")


class BadField(Exception):
    """One failed check (:mod:`broker.message_check` turns it into a ``Refused`` with the envelope's ID)."""

    def __init__(self, reason: Reason, field: str, detail: str, limit: str) -> None:
        super().__init__(detail)
        self.reason, self.field, self.detail, self.limit = reason, field, detail, limit


def kombu_loads(data: bytes) -> Any:
    """kombu's JSON decoder (``__type__`` markers for datetime, bytes, decimal, uuid included)."""
    return _kombu_loads(data)  # type: ignore[no-untyped-call]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_kind(value: Any) -> str:
    """A JSON-ish name for ``value``'s type, for messages."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    return "a number" if isinstance(value, int | float) else f"a {type(value).__name__}"


def check_headers(headers: dict[str, Any], tasks: Container[str] | None) -> None:
    """The headers Celery reads, each of the type it assumes; with ``tasks`` (the registered task names, or
    None to skip the check), a registered ``fleet.*`` task."""
    task = _check_identity(headers)
    _check_header_types(headers)
    for key in ("eta", "expires"):
        _check_time(headers, key)
    _check_timelimit(headers.get("timelimit"))
    if tasks is not None and task not in tasks:
        raise BadField(Reason.UNKNOWN_TASK, "headers.task", f"no task named {task!r}"[:300] + " is registered here",
                       "a registered task")
    if tasks is not None and not task.startswith(FLEET_TASK_PREFIX):
        raise BadField(Reason.UNKNOWN_TASK, "headers.task", f"task {task!r}"[:300] + " is not one of the fleet's "
                       f"tasks: only {FLEET_TASK_PREFIX}* tasks run on its queues", f"a {FLEET_TASK_PREFIX}* task")


def _check_identity(headers: dict[str, Any]) -> str:
    """``task`` and ``id``: what the strategy and the result key need; returns the task name."""
    task = headers.get("task")
    if "task" not in headers:
        raise BadField(Reason.BAD_HEADERS, "headers.task",
                       "headers.task is missing: not a Celery protocol 2 message (protocol 1 is not accepted)",
                       "Celery task protocol 2")
    if not isinstance(task, str) or not task:
        raise BadField(Reason.BAD_HEADERS, "headers.task", f"headers.task must be a task name; got {json_kind(task)}",
                       "a task name")
    task_id = headers.get("id")
    # a fleet task's ID is its request's ID: held to the rule of every face that takes one (at most 128 ASCII
    # characters: MAX_TASK_ID_CHARS), since it names the result's key
    if not isinstance(task_id, str) or not re.fullmatch(REQUEST_ID_PATTERN, task_id):
        got = (f"{task_id[:40]!a}{'…' if len(task_id) > 40 else ''} ({len(task_id)} characters)"
               if isinstance(task_id, str) else json_kind(task_id))  # fmt: skip
        raise BadField(Reason.BAD_HEADERS, "headers.id", f"headers.id must be a request ID, {REQUEST_ID_RULE}; got "
                       f"{got}: the ID names the result's key and GET /v1/requests/{{id}}, so no result is stored "
                       "under this one", REQUEST_ID_PATTERN)  # fmt: skip
    if not utf8_text(task):
        raise BadField(Reason.BAD_HEADERS, "headers.task", "headers.task holds a lone surrogate (a \\uD800-\\uDFFF "
                       "escape): not UTF-8 text", "UTF-8 text")  # fmt: skip
    return task


def _check_header_types(headers: dict[str, Any]) -> None:
    """The optional headers Celery reads, each of the type it assumes."""
    for key in _OPTIONAL_STR_HEADERS:
        if headers.get(key) is not None and not isinstance(headers[key], str):
            raise BadField(Reason.BAD_HEADERS, f"headers.{key}",
                           f"headers.{key} must be a string or null; got {json_kind(headers[key])}", "string or null")
    for key in _OPTIONAL_INT_HEADERS:
        if headers.get(key) is not None and not (is_int(headers[key]) and headers[key] >= 0):
            raise BadField(Reason.BAD_HEADERS, f"headers.{key}",
                           f"headers.{key} must be a non-negative integer or null; got {headers[key]!r}"[:300],
                           "integer >= 0 or null")
    stamped = headers.get("stamped_headers")
    if stamped is not None and not (isinstance(stamped, list) and all(isinstance(v, str) for v in stamped)):
        raise BadField(Reason.BAD_HEADERS, "headers.stamped_headers",
                       f"headers.stamped_headers must be a list of strings or null; got {json_kind(stamped)}",
                       "list of strings or null")
    if headers.get("stamps") is not None and not isinstance(headers["stamps"], dict):
        raise BadField(Reason.BAD_HEADERS, "headers.stamps",
                       f"headers.stamps must be an object or null; got {json_kind(headers['stamps'])}",
                       "object or null")
    if headers.get("ignore_result") not in (None, False):  # the task would run and its answer be dropped
        raise BadField(Reason.BAD_HEADERS, "headers.ignore_result",
                       f"headers.ignore_result must be false or null; got {headers['ignore_result']!r}"[:300] + ": the "
                       "fleet answers every request under its ID", "false or null")
    for key in sorted(_EMBED_KEYS & headers.keys()):
        if headers[key] is not None:  # Celery copies headers into the task's request context
            raise BadField(Reason.BAD_HEADERS, f"headers.{key}", f"headers.{key} must not be set (it belongs in the "
                           "body's embed object)", "null")


def _check_time(headers: dict[str, Any], key: str) -> None:
    value = headers.get(key)
    if value is None:
        return
    if not isinstance(value, str):
        raise BadField(Reason.BAD_HEADERS, f"headers.{key}",
                       f"headers.{key} must be an ISO 8601 string or null; got {json_kind(value)}", "ISO 8601")
    try:
        eta_unix_s(value)  # read as Request.__init__ reads it ('' too: it parses to None there, then fails)
    except ValueError as exc:  # dateutil's OverflowError, … come wrapped: named by their own class
        why = type(exc.__cause__ or exc).__name__
        raise BadField(Reason.BAD_HEADERS, f"headers.{key}",
                       f"headers.{key} is not an ISO 8601 time: {value!r}"[:300] + f" ({why})", "ISO 8601") from exc


def _check_timelimit(value: Any) -> None:
    if value is None:
        return
    ok = isinstance(value, list) and len(value) == 2 and all(
        v is None or (isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e9) for v in value
    )
    if not ok:
        raise BadField(Reason.BAD_HEADERS, "headers.timelimit",
                       f"headers.timelimit must be [hard_s, soft_s] (numbers >= 0 or null); got {value!r}"[:300],
                       "[hard_s, soft_s]")


def body_bytes(doc: dict[str, Any]) -> bytes:
    """The body as the bytes the deserializer would get, or why it cannot be read."""
    content_type = doc.get("content-type")
    if content_type == PICKLE_CONTENT_TYPE:
        raise BadField(Reason.PICKLE, "content-type", f"content type {PICKLE_CONTENT_TYPE!r} (pickle) is disallowed: "
                       "this fleet accepts JSON only", JSON_CONTENT_TYPE)
    if content_type != JSON_CONTENT_TYPE:
        shown = repr(content_type)[:100] if isinstance(content_type, str) else json_kind(content_type)
        raise BadField(Reason.CONTENT_TYPE, "content-type",
                       f"content type {shown} is disallowed: this fleet accepts JSON only", JSON_CONTENT_TYPE)
    encoding = doc.get("content-encoding")
    if encoding is not None and (not isinstance(encoding, str) or encoding.lower() not in _UTF8):
        raise BadField(Reason.BAD_ENCODING, "content-encoding",
                       f"content-encoding must be utf-8; got {encoding!r}"[:200], "utf-8")
    compression = doc["headers"].get("compression")
    if compression:
        raise BadField(Reason.BAD_ENCODING, "headers.compression",
                       f"compressed bodies are not accepted (headers.compression={compression!r}); send JSON "
                       "uncompressed"[:300], "no compression")
    body_encoding = doc["properties"].get("body_encoding")
    body: str = doc["body"]
    if body_encoding == "base64":
        try:  # kombu's Base64 codec: not strict about stray characters, strict about padding
            return base64.b64decode(body.encode("utf-8"))
        except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
            raise BadField(Reason.BAD_ENCODING, "body", f"body is not base64 ({exc})", "base64") from exc
    # kombu's decode_body: a falsy or 'utf-8' (any case) encoding leaves the text as is; any other
    # name is looked up as-is among its codecs, of which 'base64' is the only one
    if not body_encoding or (isinstance(body_encoding, str) and body_encoding.lower() == "utf-8"):
        try:
            return body.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadField(Reason.BAD_ENCODING, "body", f"body is not UTF-8 text ({exc})", "utf-8") from exc
    raise BadField(Reason.BAD_ENCODING, "properties.body_encoding",
                   f"properties.body_encoding must be base64 or utf-8; got {body_encoding!r}"[:200], "base64")


def check_body(body: bytes) -> list[Any]:
    """``body`` (from :func:`body_bytes`) decoded as Celery's JSON deserializer would: ``[args, kwargs, embed]``."""
    if not body:
        raise BadField(Reason.BODY_NOT_JSON, "body", "body is empty", BODY_LAYOUT)
    try:
        decoded = kombu_loads(body)
    except Exception as exc:  # the same decoder Celery's json deserializer uses; hostile input raises anything
        raise BadField(Reason.BODY_NOT_JSON, "body",
                       f"body is not JSON ({type(exc).__name__}: {exc})"[:500], BODY_LAYOUT) from exc
    if not isinstance(decoded, list) or len(decoded) != 3:
        shape = f"a list of {len(decoded)}" if isinstance(decoded, list) else json_kind(decoded)
        raise BadField(Reason.BAD_BODY, "body", f"body is {shape}; Celery protocol 2 needs {BODY_LAYOUT}", BODY_LAYOUT)
    args, kwargs, embed = decoded
    for i, (value, want, ok) in enumerate(
        ((args, "a list", isinstance(args, list)), (kwargs, "an object", isinstance(kwargs, dict)),
         (embed, "an object", isinstance(embed, dict)))
    ):
        if not ok:
            raise BadField(Reason.BAD_BODY, f"body[{i}]", f"body[{i}] must be {want}; got {json_kind(value)}",
                           BODY_LAYOUT)
    _check_embed(embed)
    return decoded


def _check_embed(embed: dict[str, Any]) -> None:
    """Only the keys Celery writes, each null or empty: the fleet runs no callbacks, errbacks, chains or
    chords, and Celery acts on them outside the task body, where a bad one raised and left the message
    unacked (its worker slot taken for good)."""
    unknown = sorted(set(embed) - _EMBED_KEYS)
    if unknown:
        raise BadField(Reason.BAD_BODY, f"body[2].{unknown[0]}"[:100],
                       f"body[2] may only hold {', '.join(sorted(_EMBED_KEYS))}; got {unknown[0]!r}"[:300],
                       "callbacks, chain, chord, errbacks")
    for key in sorted(_EMBED_KEYS & embed.keys()):
        value = embed[key]
        if value is None or (isinstance(value, list | dict) and not value):
            continue
        raise BadField(Reason.BAD_BODY, f"body[2].{key}",
                       f"body[2].{key} must be null or empty; got {json_kind(value)}"
                       f"{f' of {len(value)}' if isinstance(value, list | dict) else ''}: the fleet runs no "
                       "callbacks, errbacks, chains or chords (a request's outcome is its own result)", "null")
