"""The rest of a token stream, rebuilt from the request's stored result (pure: no I/O).

A stream can stop short of its end while the request itself finished: events lost with a Redis
that restarted without persistence, a worker whose publisher gave up, entries trimmed by
``MAXLEN`` before a late reader got to them. The stored result is the truth a stream only
previews, so a reader that finds it stored finishes from it (:func:`ending_events`):

* the token indexes the reader has not handed on, each with its token id from
  ``generation.token_ids`` — same indexes, no gap, nothing handed on twice;
* the text the stream has not shown yet (``generation.text`` past what was shown) rides on the
  first of those tokens (on the final event when none is missing): the concatenated text equals the
  stored text; the per-token split of the missing part is not kept in the result, so it is one piece;
* the ``final`` event with the stored finish reason and usage.

A stored failure ends the stream with an ``error`` event naming the error, as a worker's own
error event does.
"""

from __future__ import annotations

from protocol.errors import FleetError
from protocol.messages import InferenceResult
from protocol.streams import StreamEvent

__all__ = ["ending_events", "error_event"]


def error_event(err: FleetError) -> StreamEvent:
    """The ``error`` event that says ``err`` (type name, message, field, limit)."""
    return StreamEvent(
        type="error", index=0, error=type(err).__name__, message=err.message, field=err.field, limit=err.limit
    )


def ending_events(
    request_id: str, outcome: InferenceResult | FleetError, *, highest_index: int, shown_text: str
) -> list[StreamEvent]:
    """The events that end a stream whose reader handed on tokens ``0..highest_index`` showing ``shown_text``.

    The last event returned is always ``final`` or ``error``.
    """
    if isinstance(outcome, FleetError):
        return [error_event(outcome)]
    gen = outcome.generation
    if gen is None:
        msg = f"request {request_id} is a {outcome.kind} request: only generations stream; its result is stored"
        return [error_event(FleetError(msg, "request_id", None))]
    text = gen.text or ""
    if shown_text.startswith(text) and highest_index >= len(gen.token_ids) - 1:
        # the reader saw more than the result kept (a first attempt went further than the redelivered
        # one, cut by its deadline): as the stream itself would, end with the stored final
        return [StreamEvent(
            type="final", index=len(gen.token_ids), finish_reason=gen.finish_reason, usage=gen.usage, text=""
        )]
    if not text.startswith(shown_text):
        # cannot happen for one request (generation is a pure function of it); say so rather than guess
        msg = (f"the stream of {request_id} showed text that is not in its stored result; "
               f"read the result by its ID instead")
        return [error_event(FleetError(msg, "request_id", None))]
    rest = text[len(shown_text):]
    out = []
    for index in range(highest_index + 1, len(gen.token_ids)):
        out.append(StreamEvent(type="token", index=index, token_id=gen.token_ids[index], text=rest))
        rest = ""
    out.append(StreamEvent(
        type="final", index=len(gen.token_ids), finish_reason=gen.finish_reason, usage=gen.usage, text=rest
    ))
    return out
