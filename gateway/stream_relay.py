"""The gateway's reader of a generation's stream, for the native SSE route and the OpenAI routes alike.

:func:`relay_events` is :func:`producer.streams.aiter_events` on the gateway's ``redis.asyncio``
client, its waits shared with every other relayed stream (:class:`gateway.stream_hub.StreamHub`: one
``XREAD`` for all), with the stored result as its backstop: a stream that stopped short of its end (events
lost in a Redis restart, a worker that could not write them) ends from the stored result (same
token indexes, same text), and the reader never waits for events that can no longer come. While
Redis does not answer it tries again, for up to :data:`producer.streams.MAX_OUTAGE_S`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

from gateway.deps import Gateway
from gateway.outcomes import WAIT_S
from producer.streams import ReadOptions, aiter_event_batches, aiter_events
from protocol.errors import FleetError
from protocol.keys import CANCEL_KEY
from protocol.messages import InferenceResult
from protocol.streams import StreamEvent

__all__ = ["relay_event_batches", "relay_events", "stored_outcome"]

Outcome = InferenceResult | FleetError


async def stored_outcome(gw: Gateway, request_id: str) -> Outcome | None:
    """``request_id``'s stored result or error, read the way the client reads it; None while it has none.
    A request cancelled while queued has ended (``RequestCancelled``): its cancel mark is read in the same
    ``MGET`` (:func:`protocol.cancel_marks.cancelled_before_run`), so its stream ends within one read's block."""
    raw, mark = await gw.aredis.mget([gw.fleet.app.backend.get_key_for_task(request_id),
                                      CANCEL_KEY.format(id=request_id)])  # fmt: skip
    return gw.fleet.outcome_stored(request_id, raw, mark)


def relay_events(gw: Gateway, request_id: str, *, timeout_s: float = WAIT_S) -> AsyncIterator[StreamEvent]:
    """Each event of ``request_id``'s stream once, ending with ``final`` or ``error`` (see the module).

    Raises (while iterating):
        ResultTimeout: nothing arrived for ``timeout_s`` and no result is stored.
        DecodeError: an entry is not a stream event.
        redis.ConnectionError, redis.TimeoutError: Redis did not answer for ``MAX_OUTAGE_S``.
    """
    return aiter_events(gw.aredis, request_id, timeout_s=timeout_s, **_relayed(gw, request_id))


def relay_event_batches(gw: Gateway, request_id: str, *, timeout_s: float = WAIT_S) -> AsyncIterator[list[StreamEvent]]:
    """:func:`relay_events`' events as each read brings them (non-empty lists): a relay writes one read's
    events to its client in one piece, one write instead of one per token."""
    return aiter_event_batches(gw.aredis, request_id, timeout_s=timeout_s, **_relayed(gw, request_id))


def _relayed(gw: Gateway, request_id: str) -> ReadOptions:
    """How the gateway reads a stream: the stored result as its backstop, its waits in the stream hub."""
    return {"outcome": partial(stored_outcome, gw, request_id), "read": gw.streams.xread}
