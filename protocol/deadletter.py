"""Dead-letter entries: the queue items a worker refused or gave up on, kept with why and where.

Workers push one JSON :class:`DeadLetter` per item onto the Redis list ``fleet:dead-letter``
(:data:`protocol.keys.DEAD_LETTER_KEY`, newest first, capped at :data:`MAX_ENTRIES`); the
``fleet dead-letter`` commands read them. The entry keeps the raw item byte for byte (UTF-8 text
when it is, else base64), so ``requeue`` can put the original message back on the list it came from.

Reasons (:class:`Reason`), in the order a worker checks them:

* ``not_json``: the queue item is not JSON; ``not_a_message``: JSON, but not a kombu envelope
  (``body``, ``headers``, ``properties.delivery_tag``/``delivery_info`` of the right types);
* ``max_deliveries``: delivered more than ``worker.max_deliveries`` times without an ack (its
  worker died each time: segfault, OOM kill, ``os._exit``);
* ``bad_headers``: not Celery protocol 2 headers (``task``, ``id``, ``eta``, ``timelimit``, …);
  ``unknown_task``: no worker task of that name;
* ``pickle`` and ``content_type``: the body is not JSON-serialized (the fleet accepts JSON only);
  ``bad_encoding``: ``body_encoding``, ``content-encoding`` or compression the fleet does not read;
* ``body_not_json``: the body does not parse as JSON; ``bad_body``: it does, but is not
  ``[args (list), kwargs (object), embed (object)]``;
* ``eta_beyond_visibility``: a well-formed message whose ``eta`` (a Celery client's ``countdown``/``eta``)
  is further ahead than a worker may hold it: past ``visibility_timeout_s`` the Redis broker hands a held
  message to another worker and it would run twice (the limit: :func:`broker.eta_window.max_eta_ahead_s`);
* ``worker_error``: it passed every check and Celery still raised on it (a guard of last resort).

Only ``unknown_task`` and ``max_deliveries`` entries can be requeued as they are
(:func:`requeue_allowed`): the others would be refused again. An ``eta_beyond_visibility`` entry is
refused again only until its ETA comes within the limit; from then on it can be requeued as it is
(``fleet dead-letter requeue`` checks its ETA against the time and the visibility timeout).

One copy per request ID: a request ID can be dead-lettered more than once (two copies of its message, e.g.
one redelivered while the other was held; or two bulk messages, or a bulk and a single, carrying it under
different task IDs). A requeue claims every ID it puts back (its task ID, a bulk message's request IDs) under
:data:`REQUEUED_KEY` until an outcome is stored; a later requeue of a bulk message leaves out the requests
claimed (or with an outcome), one whose every request is claimed is refused, naming them, and a single whose ID
is claimed is refused. Entries whose every request went back are marked ``superseded_by`` the entry requeued
(kept, listed, refused while the copy is out).
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from protocol.errors import DecodeError
from protocol.messages import FLEET_TASK_PREFIX

__all__ = [
    "DEAD_LETTERED",
    "MAX_ENTRIES",
    "MAX_RAW_BYTES",
    "REQUEUED_KEY",
    "REQUEUE_CLAIM_TTL_S",
    "UNKNOWN_QUEUE",
    "DeadLetter",
    "Reason",
    "decode_entry",
    "encode_entry",
    "make_entry",
    "read_entry",
    "requeue_allowed",
]

DEAD_LETTERED = "dead-lettered"
"""How the message of the FAILURE a dead-lettering stores begins (``dead-lettered (<reason>): …``): what
``fleet dead-letter requeue`` clears, and no other FAILURE."""
MAX_ENTRIES = 10_000
"""The dead-letter list keeps this many entries (the oldest go first)."""
MAX_RAW_BYTES = 32 * 1024 * 1024
"""An entry keeps at most this many bytes of its item (32 MiB): the first ones, with the whole size and SHA-256
(:func:`make_entry`). Far above any message a fleet client writes, far below Redis's 512 MB for one value."""
TEXT_GROWTH_LIMIT = 2
"""An item is kept as text when its JSON form is at most this many times its size, else as base64."""
REQUEUED_KEY = "fleet:dead-letter-requeued:{id}"
"""A request ID's requeue claim (a task ID's, or a bulk message's request's): JSON ``{"entry": <the entry
requeued>, "at_unix_s": <wall s>}``, set by the step that puts the message back, and refusing another requeue
of the ID (or dropping it from a bulk message put back) until its outcome is stored."""
REQUEUE_CLAIM_TTL_S = 3600
"""How long a requeue claim lasts (s) when the caller gives none (the CLI gives ``result_ttl_s``): a copy
that never stores an outcome (its queue flushed) blocks requeues of its ID no longer than this."""
UNKNOWN_QUEUE = "unknown"
"""The queue of a ``legacy`` entry whose item names none (it cannot be requeued)."""


class Reason(StrEnum):
    """Why an item was dead-lettered (see the module docstring)."""

    NOT_JSON = "not_json"
    NOT_A_MESSAGE = "not_a_message"
    MAX_DELIVERIES = "max_deliveries"
    BAD_HEADERS = "bad_headers"
    UNKNOWN_TASK = "unknown_task"
    PICKLE = "pickle"
    CONTENT_TYPE = "content_type"
    BAD_ENCODING = "bad_encoding"
    BODY_NOT_JSON = "body_not_json"
    BAD_BODY = "bad_body"
    ETA_BEYOND_VISIBILITY = "eta_beyond_visibility"
    WORKER_ERROR = "worker_error"
    LEGACY = "legacy"


_REQUEUE_SAFE = frozenset({Reason.MAX_DELIVERIES, Reason.UNKNOWN_TASK})


def requeue_allowed(reason: Reason, task: str | None = None) -> bool:
    """True when requeueing an entry of this reason (and, for ``unknown_task``, this task name) can succeed as it
    is (no ``--force`` needed): an unknown ``fleet.*`` task may be known to a newer worker; any other name
    (``celery.backend_cleanup``…) is refused again by every worker. False for ``eta_beyond_visibility``, which
    depends on the time as well: ``producer.deadletter.requeue_refusal`` decides it."""
    if reason is Reason.UNKNOWN_TASK:
        return task is not None and task.startswith(FLEET_TASK_PREFIX)
    return reason in _REQUEUE_SAFE


class DeadLetter(BaseModel):
    """One dead-lettered queue item. Times are wall-clock Unix seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    id: str = Field(min_length=1, description="This entry's ID (not the task's).")
    reason: Reason
    detail: str = Field(description="What was wrong, in words.")
    field: str | None = Field(default=None, description="The part of the item that broke, e.g. 'body[1]'.")
    queue: str = Field(description="The queue the item was taken from.")
    list_key: str = Field(description="The Redis list it was popped from (a priority list has a suffix).")
    task_id: str | None = Field(default=None, description="The message's task ID, when it had a usable one.")
    task: str | None = Field(default=None, description="The task name in its headers, when it had one.")
    worker: str | None = Field(default=None, description="Hostname of the worker that dead-lettered it.")
    deliveries: int | None = Field(default=None, description="Deliveries counted (max_deliveries entries).")
    dead_lettered_at_unix_s: float
    raw: str = Field(description="The queue item, as text (raw_encoding utf-8) or base64.")
    raw_encoding: Literal["utf-8", "base64"] = "utf-8"
    superseded_by: str | None = Field(
        default=None, description="The entry a requeue put back instead of this one (every request ID it carries)."
    )
    raw_truncated_from: int | None = Field(
        default=None, ge=0, description="The item's whole size (bytes) when ``raw`` keeps only its first "
        "MAX_RAW_BYTES bytes (None: ``raw`` is the whole item); such an entry cannot be requeued.",
    )
    raw_sha256: str | None = Field(default=None, description="SHA-256 of the whole item (hex), when truncated.")

    @model_validator(mode="after")
    def _raw_reads_back(self) -> DeadLetter:
        """``raw`` must give back bytes (:meth:`raw_bytes`): strict base64, or text without lone surrogates. A
        worker never writes anything else; an entry changed by hand that breaks this is read as a ``legacy``
        item (:func:`read_entry`) instead of failing ``show`` and ``requeue``."""
        try:
            self.raw_bytes()
        except ValueError as exc:  # binascii.Error and UnicodeEncodeError are ValueErrors
            raise ValueError(f"raw is not {self.raw_encoding}: {exc}") from exc
        return self

    def raw_bytes(self) -> bytes:
        """The queue item exactly as it was popped (its first :data:`MAX_RAW_BYTES`: :attr:`raw_truncated_from`)."""
        if self.raw_encoding == "base64":
            return base64.b64decode(self.raw, validate=True)
        return self.raw.encode("utf-8")

    def summary(self) -> dict[str, object]:
        """The columns ``fleet dead-letter list`` prints."""
        return {
            "id": self.id,
            "reason": self.reason.value,
            "field": self.field,
            "queue": self.queue,
            "task_id": self.task_id,
            "task": self.task,
            "dead_lettered_at_unix_s": self.dead_lettered_at_unix_s,
            "detail": self.detail,
            "superseded_by": self.superseded_by,
        }


def make_entry(
    raw: bytes,
    *,
    reason: Reason,
    detail: str,
    field: str | None,
    queue: str,
    list_key: str,
    now_unix_s: float,
    task_id: str | None = None,
    task: str | None = None,
    worker: str | None = None,
    deliveries: int | None = None,
) -> DeadLetter:
    """A new entry for ``raw`` with a fresh ID: its first :data:`MAX_RAW_BYTES` bytes (all of a smaller item, the
    usual case), as text where that is UTF-8 that JSON keeps about as long, else as base64.

    An item of control bytes written as JSON text grows six times (``\u0001`` for each byte): a 90 MB item became
    a 540 MB entry, over Redis's 512 MB for one value, so the entry's write failed and the item, already taken
    off its queue, was gone without a trace. A larger item keeps its first bytes, its size and its SHA-256."""
    whole = len(raw)
    kept = raw[:MAX_RAW_BYTES]
    text, encoding = _stored_form(kept)
    truncated = whole > len(kept)
    return DeadLetter(
        id=uuid.uuid4().hex,
        reason=reason,
        detail=detail,
        field=field,
        queue=queue,
        list_key=list_key,
        task_id=task_id,
        task=task,
        worker=worker,
        deliveries=deliveries,
        dead_lettered_at_unix_s=now_unix_s,
        raw=text,
        raw_encoding=encoding,
        raw_truncated_from=whole if truncated else None,
        raw_sha256=hashlib.sha256(raw).hexdigest() if truncated else None,
    )


def _stored_form(raw: bytes) -> tuple[str, Literal["utf-8", "base64"]]:
    """``raw`` as the entry keeps it: UTF-8 text unless it is not UTF-8, or its JSON form would be more than
    :data:`TEXT_GROWTH_LIMIT` times its size (control characters, each written as six), then base64 (4/3)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode("ascii"), "base64"
    if len(json.dumps(text, ensure_ascii=False)) - 2 > TEXT_GROWTH_LIMIT * len(raw):  # less its quotes
        return base64.b64encode(raw).decode("ascii"), "base64"
    return text, "utf-8"


def encode_entry(entry: DeadLetter) -> bytes:
    """The list item for ``entry``."""
    return entry.model_dump_json().encode("utf-8")


def decode_entry(data: bytes) -> DeadLetter:
    """Parse one list item written by :func:`encode_entry`.

    Raises:
        DecodeError: ``data`` is not such an entry (the field that broke is named).
    """
    try:
        return DeadLetter.model_validate_json(data)
    except ValidationError as exc:
        errs = exc.errors()
        field = ".".join(str(p) for p in errs[0]["loc"]) if errs and errs[0]["loc"] else "entry"
        raise DecodeError(f"not a dead-letter entry: {errs[0]['msg'] if errs else exc}", field, None) from exc


def read_entry(data: bytes) -> DeadLetter:
    """Like :func:`decode_entry`, but an item from before entries had a schema (the bare queue item that
    an older worker pushed) becomes a ``legacy`` entry whose ID is derived from its bytes."""
    try:
        return decode_entry(data)
    except DecodeError:
        pass
    queue = UNKNOWN_QUEUE
    try:
        doc = json.loads(data)
        routing_key = doc["properties"]["delivery_info"]["routing_key"]
        if isinstance(routing_key, str) and routing_key:
            queue = routing_key
    except Exception:  # a legacy item is anything at all; the queue is only a hint
        pass
    entry = make_entry(
        data,
        reason=Reason.LEGACY,
        detail="pushed by a worker before dead-letter entries had a schema",
        field=None,
        queue=queue,
        list_key=queue,
        now_unix_s=0.0,
    )
    return entry.model_copy(update={"id": "legacy-" + hashlib.sha256(data).hexdigest()[:16]})
