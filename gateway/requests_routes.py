"""The native API's routes under ``/v1/requests`` (tag ``requests``): submit one request or a batch,
read (or long-poll) a request's view, cancel it, and relay a generation's token events as SSE.

The submit steps (build, wait, queue, the 202's body): :mod:`gateway.native_submit`; the waits for a
result: :mod:`gateway.request_waits`. Routes that only touch Redis are plain ``def`` (FastAPI's thread
pool); those that wait are ``async`` on redis.asyncio. The whole API: :mod:`gateway.app`.

With auth on, a request submitted here belongs to the API key that submitted it (its owner mark,
:mod:`gateway.request_owners`): every route under ``/v1/requests/{id}`` answers another key's request with the
404 of an unknown ID, checked before its result is read (and, where the ID had no mark then, again after: another
key may have queued it in between); a caller-given ``request_id`` another key's request
holds is refused with a 409 (whatever the body), nothing queued. A request without a mark (submitted by
``FleetClient``, the CLI or a plain Celery client straight to Redis, or before marks were kept) is any
accepted key's to read and cancel.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter as Tally
from collections.abc import AsyncIterator
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, Header, Path, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from gateway.deps import CallerDep, Gateway, GatewayDep
from gateway.errors import error_payload, relay_error
from gateway.native_submit import (
    accepted,
    build_submitted,
    checked_wait,
    no_worker_warning,
    no_worker_warning_now,
    queue_submitted,
    submit_wait,
)
from gateway.plain_numbers import DIGIT_SECONDS
from gateway.request_owners import FOREIGN, UNMARKED
from gateway.request_waits import long_polled_view, view_when_done, view_when_published
from gateway.schema import (
    REQUEST_ID_PATTERN,
    BatchAccepted,
    BatchSubmitBody,
    ErrorBody,
    RequestAccepted,
    RequestView,
    SubmitBody,
)
from gateway.sse import EventStream, sse_frame
from gateway.stream_relay import relay_event_batches
from gateway.views import read_view, read_view_sync
from producer.client import RequestStatus
from producer.idempotent_queue import one_body_per_id, request_fingerprint
from producer.results import CANCEL_SETTLE_S
from protocol.cancel_marks import cancelled_for_good
from protocol.errors import FleetError, InvalidRequest, RequestNotFound
from protocol.keys import CANCEL_KEY, REQUEST_KEY, STREAM_KEY
from protocol.streams import StreamEvent

__all__ = [
    "STREAM_GRACE_S",
    "PreferHeader",
    "RequestId",
    "WaitS",
    "cancel",
    "get_request",
    "router",
    "stream",
    "submit",
    "submit_batch",
]

STREAM_GRACE_S = 2.0
"""How long a finished request without a stream is re-checked before it is called stream-less (s)."""


def _json(model: BaseModel, status: int = 200, *, exclude_none: bool = False,
          headers: dict[str, str] | None = None) -> Response:  # fmt: skip
    """``model`` as the response body, serialized once by pydantic (the route's ``response_model`` stays
    what OpenAPI documents; FastAPI does not validate and serialize a returned ``Response`` again)."""
    response = Response(model.model_dump_json(exclude_none=exclude_none), status_code=status,
                        media_type="application/json")  # fmt: skip
    response.headers.update(headers or {})  # after Content-Type, where a route's own headers always came
    return response


def _error(status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(payload, status_code=status, headers=headers)


router = APIRouter()
RequestId = Annotated[str, Path(pattern=REQUEST_ID_PATTERN, description="The ID returned at submission.")]
WaitS = Annotated[
    float | None,
    Query(ge=0, description="Long-poll: answer as soon as the result is stored, or after this many seconds with "
          "the current status (digits, e.g. 10 or 2.5; at most api.max_wait_s; default: answer at once)."),
    DIGIT_SECONDS,
]  # fmt: skip
PreferHeader = Annotated[
    str | None,
    Header(description="RFC 7240 preferences; `wait=<s>` on a submit: answer with the result if it is stored "
           "within that many seconds (at most api.max_wait_s), as `Prefer: wait` does on other job APIs."),
]  # fmt: skip


@router.post("/v1/requests", status_code=202, response_model=RequestAccepted, response_model_exclude_none=True,
             tags=["requests"], responses={200: {"model": RequestView, "description": "with ``wait_s`` (or "
             "``Prefer: wait``): the request finished within the wait; the body is its view, as GET answers"}})
async def submit(body: SubmitBody, rate_key: CallerDep, gw: GatewayDep, wait_s: WaitS = None,
                 prefer: PreferHeader = None) -> Response:  # fmt: skip
    """Validate, admit and queue one request; poll ``Location`` for its result.

    A caller-given ``request_id`` is an idempotency key: resubmitting the same body answers the
    request's real status (it may have finished long ago); another body under a known ID is 409.
    Without one, the request is queued with the others that arrive meanwhile
    (:mod:`gateway.submit_queue`, ``api.group_submits``).

    ``wait_s`` (s, up to ``api.max_wait_s``; more is a 422 naming the limit), or the header
    ``Prefer: wait=<s>`` (RFC 7240; a longer wait is cut to ``api.max_wait_s`` and the header
    ``Preference-Applied`` says the wait applied): wait for the result on the event loop and answer 200 with
    the request's view (what ``GET`` answers) as soon as it is stored; else, at the end of the wait, 202
    as without a wait, with the status then. One HTTP exchange per request instead of a submit and a GET.
    """
    wait, applied = submit_wait(gw, wait_s, prefer)
    if body.text is None and gw.fleet.model_loaded(body.model):  # no file, no Redis read: on the loop
        request = build_submitted(gw, body)
    else:
        request = await run_in_threadpool(build_submitted, gw, body)
    view: RequestView | None = None
    if wait and body.request_id is None:  # a new ID: subscribed before it is queued, nothing stored to read first
        key = gw.fleet.app.backend.get_key_for_task(request.request_id)
        async with gw.results.watching([key]) as watch:
            rid, status = await queue_submitted(gw, request, rate_key, body)
            view = await view_when_published(gw, rid, watch, wait)
    else:
        rid, status = await queue_submitted(gw, request, rate_key, body)
        if wait:  # a caller-given ID may be finished already: its result is read first
            view = await view_when_done(gw, rid, wait)
    headers = {"Location": f"/v1/requests/{rid}", **applied}
    if view is not None:
        return _json(view, 200, headers=headers)
    if wait:
        status = (await read_view(gw.fleet, gw.aredis, rid))[0].status  # the status at the end of the wait
    warning = await no_worker_warning_now(gw, request.model) if status is RequestStatus.QUEUED else None
    return _json(accepted(rid, status, warning), 202, exclude_none=True, headers=headers)


async def _no_batch_wait(wait_s: Annotated[str | None, Query(include_in_schema=False)] = None) -> None:
    """Refuse ``wait_s`` on the batch route (InvalidRequest naming it, before the body is validated; nothing is
    queued): a batch does not wait for its results, and the single submit's ``wait_s`` ignored there answered a 202
    that read as a wait that ran out. Other unknown query parameters are ignored, as on every route."""
    if wait_s is not None:
        raise InvalidRequest("wait_s is not taken by POST /v1/requests:batch: a batch answers once it is queued, "
                             "without waiting for results; wait for each with GET /v1/requests/{id}?wait_s=s",
                             "wait_s", None)  # fmt: skip


@router.post("/v1/requests:batch", status_code=202, response_model=BatchAccepted, response_model_exclude_none=True,
             tags=["requests"], dependencies=[Depends(_no_batch_wait)])
def submit_batch(body: BatchSubmitBody, rate_key: CallerDep, gw: GatewayDep) -> BatchAccepted | JSONResponse:
    """Queue many requests, all or none: each is validated, every request ID checked (one ID names one
    body, inside the batch too) and the batch admitted before anything is queued; then the whole batch
    is queued in one Redis step. A known ID with the same body answers that request's real status.
    A batch does not wait for its results: ``wait_s`` is refused (422, nothing queued); wait for each with
    ``GET /v1/requests/{id}?wait_s=``."""
    cap = gw.settings.api.max_batch_requests
    if len(body.requests) > cap:
        msg = f"batch has {len(body.requests)} requests; the limit is api.max_batch_requests={cap}"
        return _error(413, InvalidRequest(msg, "requests", cap).to_payload())
    built = []
    for i, item in enumerate(body.requests):
        try:
            built.append(build_submitted(gw, item))
        except InvalidRequest as exc:
            field = f"requests[{i}].{exc.field}"
            raise type(exc)(f"requests[{i}]: {exc.message}", field, exc.limit) from exc
    one_body_per_id([str(r.request_id) for r in built], [request_fingerprint(r) for r in built],
                    lambda i: f"requests[{i}]")  # a batch naming one ID twice is refused before admission  # fmt: skip
    owners = [gw.owners.owner_for(rate_key)] * len(built)  # another key's ID is refused before admission
    with gw.owners.claimed([str(r.request_id) for r in built], owners, lambda i: f"requests[{i}]"):
        for model, count in Tally(r.model for r in built).items():
            gw.fleet.admission.check_queue(model, count)
        gw.fleet.admission.take_rate(rate_key, len(built))
        sent = gw.fleet.send_batch(built, routing_keys=[item.routing_key for item in body.requests])
    statuses = [gw.fleet.status(rid) if item.request_id else RequestStatus.QUEUED
                for rid, item in zip(sent, body.requests, strict=True)]
    return BatchAccepted(
        requests=[
            accepted(rid, status, no_worker_warning(gw, r.model) if status is RequestStatus.QUEUED else None)
            for rid, status, r in zip(sent, statuses, built, strict=True)
        ]
    )


@router.get("/v1/requests/{request_id}", response_model=RequestView, tags=["requests"])
async def get_request(request_id: RequestId, rate_key: CallerDep, gw: GatewayDep, wait_s: WaitS = None) -> Response:
    """Where the request stands, with its result or error once it has one (and, while it is queued for a
    model no live worker serves, a ``warning`` that says so).

    ``wait_s`` (s, up to ``api.max_wait_s``; a larger value is a 422 naming the limit): wait for the
    result on the event loop (:func:`gateway.outcomes.await_outcomes`, no thread per waiter) and answer
    as soon as it is stored, else at ``wait_s`` with the status then.

    Another API key's request is answered as an unknown one (404), before anything of it is read.
    """
    if wait_s is not None:
        checked_wait(gw, wait_s)
    owner = gw.owners.owner_for(rate_key)
    mark = await _check_readable(gw, request_id, owner)
    if wait_s:
        view, model = await long_polled_view(gw, request_id, wait_s)
    else:
        view, model = await read_view(gw.fleet, gw.aredis, request_id)
    if mark == UNMARKED:  # found: it may be a request another key queued since the check (marked before it is known)
        await _check_readable(gw, request_id, owner)
    warning = await no_worker_warning_now(gw, model) if view.status is RequestStatus.QUEUED else None
    return _json(view.model_copy(update={"warning": warning}) if warning else view)


@router.delete(
    "/v1/requests/{request_id}",
    response_model=RequestView,
    tags=["requests"],
    responses={409: {"model": ErrorBody, "description": "it finished (a one-step request whose batch had started)"}},
)
def cancel(request_id: RequestId, rate_key: CallerDep, gw: GatewayDep) -> RequestView | JSONResponse:
    """Cancel a queued request, a one-step request waiting in a worker's batch window, or a running generation;
    409 when it finished (a one-step request whose batch had started when the cancel came ends with its result).

    A running generation is answered once it has stopped (within a decode step): its view is then
    ``succeeded`` with ``finish_reason`` ``cancelled`` and the tokens made so far. Another API key's request is
    answered as an unknown one (404) and left alone."""
    owner = gw.owners.owner_for(rate_key)
    mark = gw.owners.mark_of(request_id, owner)
    status = gw.fleet.status(request_id) if mark != FOREIGN else RequestStatus.NOT_FOUND
    if mark == UNMARKED and status is not RequestStatus.NOT_FOUND and gw.owners.mark_of(request_id, owner) == FOREIGN:
        status = RequestStatus.NOT_FOUND  # another key queued it since the first look (its mark came first)
    if status is RequestStatus.NOT_FOUND:
        raise RequestNotFound(f"no request {request_id!r} is known", "request_id", None)
    if status is not RequestStatus.CANCELLED and not gw.fleet.cancel(request_id, settle_s=CANCEL_SETTLE_S):
        now = gw.fleet.status(request_id).value
        msg = (f"request {request_id} is {now}: only a request that has not run, or a running generation, "
               "can be cancelled")
        return _error(409, error_payload("conflict", "Conflict", msg, "request_id"))
    gw.owners.keep_with_result(request_id, owner)  # the cancel's result lives result_ttl_s from now: so does the mark
    return read_view_sync(gw.fleet, request_id)[0]


@router.get(
    "/v1/requests/{request_id}/stream",
    tags=["requests"],
    status_code=200,
    response_class=EventStream,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "SSE: one StreamEvent JSON per data: frame"},
        409: {"model": ErrorBody, "description": "the request is not a generation, or its stream is gone"},
    },
)
async def stream(request_id: RequestId, rate_key: CallerDep, gw: GatewayDep) -> Response:
    """A generation's events as they are produced (protocol.streams.StreamEvent JSON, one per frame).

    From its first token (a stream opened before the worker starts waits for it), each token index
    once, then ``final`` (finish_reason, usage) or ``error``. Leaving does not cancel the request:
    ``DELETE /v1/requests/{id}`` does. A generation cancelled before it ran (cancel-marked, nothing stored, no
    stream) is a 409 at once, as one whose cancel a worker already stored: it never makes a token (before, its
    stream waited for one for ``WAIT_S``, 600 s, where no worker took it). Another API key's request is answered
    as an unknown one (404).
    """
    owner = gw.owners.owner_for(rate_key)
    mark = await _check_readable(gw, request_id, owner)
    marker, has_stream, has_result, cancelled = await _stream_facts(gw, request_id)
    if marker is None and not has_stream:
        raise _unknown(request_id)
    if mark == UNMARKED:  # found: it may be a request another key queued since the check
        await _check_readable(gw, request_id, owner)
    kind = marker.get("kind") if marker else None
    if (kind not in (None, "generate")) or (not has_stream and (has_result or cancelled)):
        what = (f"a {kind} request" if kind not in (None, "generate")
                else "finished and has no stream (it asked for stream: false, or ended before it ran: cancelled "
                "or expired)")  # fmt: skip
        msg = f"request {request_id} is {what}: only generations stream; GET /v1/requests/{request_id} has its result"
        return _error(409, error_payload("conflict", "Conflict", msg, "request_id"))
    return EventStream(_native_frames(gw, request_id))


def _unknown(request_id: str) -> RequestNotFound:
    """The 404 of an ID nobody submitted or that expired, in :func:`gateway.views.read_view`'s words."""
    return RequestNotFound(f"no request {request_id!r} is known (never submitted, or expired)", "request_id", None)


async def _check_readable(gw: Gateway, request_id: str, owner: str) -> str:
    """Raise :func:`_unknown`'s 404 when ``request_id`` is another API key's (its owner mark names another); else
    what its mark said (:data:`~gateway.request_owners.OWN` or :data:`~gateway.request_owners.UNMARKED`: then
    look again once the request is read)."""
    mark = await gw.owners.amark_of(gw.aredis, request_id, owner)
    if mark == FOREIGN:
        raise _unknown(request_id)
    return mark


async def _stream_facts(gw: Gateway, request_id: str) -> tuple[dict[str, Any] | None, bool, bool, bool]:
    """The submit marker (None when unknown), whether the stream exists, whether the result (or a STARTED state) is
    stored, whether a cancel mark is set.

    A worker stores the result from its task thread and writes stream entries from its publisher
    thread, so a just-finished generation's stream may appear a moment after its result: a stored
    result without a stream is re-checked for up to :data:`STREAM_GRACE_S`.
    """
    deadline = time.monotonic() + STREAM_GRACE_S
    while True:
        async with gw.aredis.pipeline(transaction=False) as pipe:
            pipe.get(REQUEST_KEY.format(id=request_id))
            pipe.exists(STREAM_KEY.format(id=request_id))
            pipe.exists(gw.fleet.app.backend.get_key_for_task(request_id))
            pipe.get(CANCEL_KEY.format(id=request_id))
            raw, has_stream, has_result, mark = await pipe.execute()
        if has_stream or not has_result or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.05)
    try:
        marker = json.loads(raw) if raw else None
    except ValueError:
        marker = {}
    known = marker if isinstance(marker, dict) or marker is None else {}
    return known, bool(has_stream), bool(has_result), cancelled_for_good(mark)


async def _native_frames(gw: Gateway, request_id: str) -> AsyncIterator[bytes]:
    try:
        async for batch in relay_event_batches(gw, request_id):  # ends from the stored result if events were lost
            yield b"".join(sse_frame(event.model_dump(mode="json", exclude_none=True)) for event in batch)
    except (FleetError, redis.RedisError) as exc:  # silence past WAIT_S, an unreadable entry, Redis trouble
        err = relay_error(exc, request_id)
        error = StreamEvent(type="error", index=0, error=type(err).__name__, message=err.message, field=err.field)
        yield sse_frame(error.model_dump(mode="json", exclude_none=True))

