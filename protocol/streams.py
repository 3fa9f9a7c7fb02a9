"""Token streams: the events a worker appends to a generation's Redis Stream, and their decoding.

Key ``fleet:stream:<request_id>`` (:data:`protocol.keys.STREAM_KEY`). Each entry holds one or more JSON
:class:`StreamEvent` s of that stream, in order: field ``e`` the first and, when the worker coalesced
several (the tokens of several decode steps that waited for the same write), field ``r`` a JSON array of
the others (:func:`encode_events`, :func:`decode_events`). A reader that knows only ``e`` sees the first
event of each entry, so an index gap, and finishes the stream from the stored result. The events:

* ``{"type": "token", "index": i, "token_id": t, "text": delta}`` — the ``i``-th generated token
  (0-based) and the text it adds (``""`` while a multi-byte character is incomplete);
* ``{"type": "final", "index": n, "finish_reason": ..., "usage": {...}, "text": delta}`` — the end,
  ``n`` = tokens generated; ``text`` is what the tokens had not yet shown (a held-back tail);
* ``{"type": "error", "index": 0, "error": type, "message": ..., "field": ..., "limit": ...}`` — the
  request failed (bad input, expired, cancelled before it ran); nothing more follows.

A redelivered request regenerates from index 0 into the same stream, so a reader keeps the highest
index it has seen and skips the rest: it sees every token once, and the same tokens (generation is
a pure function of the request, sampling included). Entries are capped (``XADD MAXLEN ~``) and the
key expires ``result_ttl_s`` after its last write.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from protocol.errors import DecodeError
from protocol.messages import FinishReason, Usage

__all__ = [
    "EVENT_FIELD", "REST_FIELD", "StreamEvent", "decode_event", "decode_events", "encode_event", "encode_events",
    "encode_token",
]  # fmt: skip

EVENT_FIELD = "e"
"""The field of an entry's first event."""
REST_FIELD = "r"
"""The field of a coalesced entry's further events: one JSON array, in order."""


class StreamEvent(BaseModel):
    """One entry of a generation's stream."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["token", "final", "error"]
    index: int
    token_id: int | None = None
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    message: str | None = None
    field: str | None = None
    limit: Any = None

    @property
    def is_last(self) -> bool:
        """True for the event that ends a stream (final or error)."""
        return self.type != "token"


def encode_event(event: StreamEvent) -> dict[str, str]:
    """The stream entry's fields for ``XADD``."""
    return {EVENT_FIELD: event.model_dump_json(exclude_none=True)}


def encode_token(index: int, token_id: int, text: str) -> str:
    """A token event's JSON, the text :func:`encode_event` writes for ``StreamEvent(type="token", index=index,
    token_id=token_id, text=text)``, without building the model: a worker encodes one per generated token
    per streaming request, and the model's validation and serialization cost several times this."""
    return f'{{"type":"token","index":{int(index)},"token_id":{int(token_id)},"text":{encode_basestring(text)}}}'


def encode_events(encoded: list[str]) -> dict[str, str]:
    """One entry's fields for events already encoded (:func:`encode_event`'s values), in stream order:
    ``e`` the first, ``r`` a JSON array of the rest (absent for one event)."""
    if len(encoded) == 1:
        return {EVENT_FIELD: encoded[0]}
    return {EVENT_FIELD: encoded[0], REST_FIELD: "[" + ",".join(encoded[1:]) + "]"}


def decode_events(fields: dict[Any, Any]) -> list[StreamEvent]:
    """Every event of one entry, in order (``e``, then the array in ``r`` when present).

    Raises:
        DecodeError: the entry has no ``e`` field, or a field does not hold events.
    """
    out = [decode_event(fields)]
    raw = fields.get(REST_FIELD, fields.get(REST_FIELD.encode()))
    if raw is None:
        return out
    try:
        rest = json.loads(raw)
        if not isinstance(rest, list):
            raise ValueError(f"{REST_FIELD!r} is not a JSON array")
        out += [StreamEvent.model_validate(item) for item in rest]
    except (ValueError, ValidationError) as exc:
        raise DecodeError(f"stream entry's {REST_FIELD!r} field is not a list of events: {exc}", "stream",
                          REST_FIELD) from exc
    return out


def decode_event(fields: dict[Any, Any]) -> StreamEvent:
    """Parse one stream entry (``bytes`` or ``str`` keys and values).

    Raises:
        DecodeError: the entry is not a stream event.
    """
    raw = fields.get(EVENT_FIELD, fields.get(EVENT_FIELD.encode()))
    if raw is None:
        raise DecodeError(f"stream entry has no {EVENT_FIELD!r} field", "stream", EVENT_FIELD)
    try:
        return StreamEvent.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        raise DecodeError(f"stream entry is not an event: {exc}", "stream", None) from exc
