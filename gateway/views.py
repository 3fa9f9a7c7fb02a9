"""``GET /v1/requests/{id}``'s answer: where a request stands, read in one Redis round trip (with auth on, the
route first reads the request's owner mark: :mod:`gateway.request_owners`).

Three keys say everything: the stored Celery meta (a finished, failed or running request), the cancel
mark, and the submit marker (a queued request, and its model for the no-live-worker warning). The
gateway reads them in one pipeline on its asyncio client (:func:`read_view`), with no thread-pool hop;
``DELETE`` reads them the same way from its thread (:func:`read_view_sync`).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio

from gateway.schema import ErrorBody, RequestView
from producer.client import FleetClient, RequestStatus
from producer.presence import marker_key, request_model
from producer.results import as_fleet_error, status_from, status_of_error
from protocol.cancel_marks import cancelled_for_good
from protocol.errors import FleetError, RequestCancelled, RequestNotFound
from protocol.keys import CANCEL_KEY
from protocol.messages import InferenceResult, decode_result

__all__ = ["ViewRead", "read_view", "read_view_sync", "view_from", "view_of_outcome"]

ViewRead = tuple[RequestView, str | None]
"""A request's view and the model its submit marker names (None when no marker or unreadable)."""


def _ask(pipe: Any, fleet: FleetClient, request_id: str) -> None:
    """Queue the three reads on ``pipe`` (a blocking or an asyncio pipeline): meta, cancel mark, marker."""
    pipe.get(fleet.app.backend.get_key_for_task(request_id))
    pipe.get(CANCEL_KEY.format(id=request_id))
    pipe.get(marker_key(request_id))


def view_from(fleet: FleetClient, request_id: str, raw_meta: bytes | None, cancel_mark: bytes | None,
              raw_marker: bytes | None) -> ViewRead:  # fmt: skip
    """The view from the three keys' values (see the module docstring).

    Raises:
        RequestNotFound: nothing is known of ``request_id`` (never submitted, or expired).
    """
    meta: dict[str, Any] | None = fleet.app.backend.decode_result(raw_meta) if raw_meta is not None else None
    status = status_from(meta, cancel_marked=cancelled_for_good(cancel_mark), known=raw_marker is not None)
    if status is RequestStatus.NOT_FOUND:
        raise RequestNotFound(f"no request {request_id!r} is known (never submitted, or expired)", "request_id", None)
    view = RequestView(request_id=request_id, status=status)
    model = request_model(raw_marker)
    if status in (RequestStatus.QUEUED, RequestStatus.RUNNING):
        return view, model
    value = meta.get("result") if meta else None
    if status is RequestStatus.SUCCEEDED:
        return view.model_copy(update={"result": decode_result(value).model_dump(mode="json")}), model
    err: FleetError
    if status is RequestStatus.CANCELLED and not isinstance(value, FleetError):  # revoked, or cancel-marked
        err = RequestCancelled.before_run(request_id)
    else:
        err = as_fleet_error(value)
    return view.model_copy(update={"error": ErrorBody(**err.to_payload())}), model


def view_of_outcome(request_id: str, outcome: InferenceResult | FleetError) -> RequestView:
    """The view of a finished request from its outcome, as :func:`gateway.outcomes.await_outcomes` returns
    it (the same reading of the stored meta: no second read)."""
    if isinstance(outcome, InferenceResult):
        succeeded = RequestStatus.SUCCEEDED
        return RequestView(request_id=request_id, status=succeeded, result=outcome.model_dump(mode="json"))
    return RequestView(request_id=request_id, status=status_of_error(outcome), error=ErrorBody(**outcome.to_payload()))


async def read_view(fleet: FleetClient, aredis: redis.asyncio.Redis[bytes], request_id: str) -> ViewRead:
    """:func:`view_from`, its three keys read in one pipeline on the event loop."""
    async with aredis.pipeline(transaction=False) as pipe:
        _ask(pipe, fleet, request_id)
        raw_meta, cancel_mark, raw_marker = await pipe.execute()
    return view_from(fleet, request_id, raw_meta, cancel_mark, raw_marker)


def read_view_sync(fleet: FleetClient, request_id: str) -> ViewRead:
    """:func:`read_view` on the client's blocking connection (from a thread)."""
    with fleet.redis.pipeline(transaction=False) as pipe:
        _ask(pipe, fleet, request_id)
        raw_meta, cancel_mark, raw_marker = pipe.execute()
    return view_from(fleet, request_id, raw_meta, cancel_mark, raw_marker)
