"""Token streams: the events a worker appends to a generation's Redis Stream, and their decoding.

Key ``fleet:stream:<request_id>`` (:data:`protocol.keys.STREAM_KEY`). Each entry has one field,
``e``, holding one JSON :class:`StreamEvent`:

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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from protocol.errors import DecodeError
from protocol.messages import FinishReason, Usage

__all__ = ["EVENT_FIELD", "StreamEvent", "decode_event", "encode_event"]

EVENT_FIELD = "e"
"""The one field of every stream entry."""


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
