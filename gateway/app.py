"""The HTTP gateway (FastAPI): the native API, the OpenAI-compatible routes, health and metrics.

::

    POST   /v1/requests[?wait_s=s]    202 + Location | 200  queue one request; wait_s (or Prefer: wait=s):
                                                          200 with its view if it finishes within the wait
    POST   /v1/requests:batch         202                 queue many (all or none)
    GET    /v1/requests/{id}[?wait_s=s]  200 | 404        status + result or error; wait_s: long-poll for it
    GET    /v1/requests/{id}/stream   200 SSE | 404 | 409 a generation's token events as they come
    DELETE /v1/requests/{id}          200 | 404 | 409     cancel a queued request or a running generation
    GET    /v1/models                 200                 OpenAI's model list + versions, readiness, queue
    POST   /v1/completions, /v1/chat/completions, /v1/embeddings      OpenAI-compatible (gateway.openai_routes)
    GET    /healthz                   200                 the process is alive (HEAD too, as for /health, /readyz)
    GET    /health                    200 (empty)         the same, under vLLM's name (what guidellm probes)
    GET    /readyz[?model=m]          200 | 503           Redis reachable and >= 1 ready worker per model
    GET    /metrics                   200                 Prometheus text (plain, no auth)
    GET    /docs, /openapi.json                           OpenAPI

``/v1/*`` needs an API key when ``api.api_keys`` is set, in header ``X-API-Key`` or
``Authorization: Bearer`` (missing or wrong → 401). Native errors are JSON ``{"error", "type",
"message", "field", "limit"}``, OpenAI routes answer in OpenAI's error shape (:mod:`gateway.errors`):
413 body over ``api.max_body_bytes`` or a batch over ``api.max_batch_requests``; 422 invalid input
(e.g. more tokens than ``max_input_tokens``); 429 + ``Retry-After`` from admission control; 503 Redis down.
Open without a key: the probes, ``/metrics``, ``/docs``, ``/redoc``, ``/openapi.json``. Before any of it, a request
head is bounded in bytes, header lines and time (:mod:`gateway.request_heads`: 431, 408).
Native endpoints that touch Redis are plain ``def`` (FastAPI's thread pool); those that wait for
results or streams are ``async`` on redis.asyncio, so an open stream costs no thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter as Tally
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import redis
from fastapi import APIRouter, FastAPI, Header, Path, Query, Response
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from gateway.body_guard import JsonShapeMiddleware, RequestGuardMiddleware, bounds_for
from gateway.deps import CallerDep, Gateway, GatewayDep
from gateway.errors import ERROR_RESPONSES, error_payload, install_error_handlers, relay_error
from gateway.middleware import AccessLogMiddleware, BodyLimitMiddleware, MetricsMiddleware
from gateway.openai_routes import router as openai_router
from gateway.prefer import prefer_wait_s
from gateway.request_waits import long_polled_view, view_when_done, view_when_published
from gateway.responses_routes import router as responses_router
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
from producer.client import FleetClient, RequestStatus
from producer.idempotent_queue import one_body_per_id, request_fingerprint
from producer.presence import no_worker_message
from producer.registry import read_fleet_state, readiness_problems
from producer.results import CANCEL_SETTLE_S
from producer.submit_groups import SubmitItem
from protocol.errors import (
    FleetError,
    InvalidRequest,
    RequestNotFound,
    UnknownModel,
)
from protocol.keys import REQUEST_KEY, STREAM_KEY
from protocol.log_format import configure_logging
from protocol.messages import InferenceRequest
from protocol.process_gc import freeze_startup_objects
from protocol.settings import FleetSettings
from protocol.streams import StreamEvent

__all__ = ["create_app", "serve"]

log = logging.getLogger("fleet.api")

REDIS_DOWN_PROBLEM = "the queue (Redis) is unreachable (the gateway's log says why)"
"""What ``/readyz`` says of a Redis it cannot reach (the address and the error stay in the log)."""
STREAM_GRACE_S = 2.0
"""How long a finished request without a stream is re-checked before it is called stream-less (s)."""


def _build(gw: Gateway, body: SubmitBody) -> InferenceRequest:
    """Validate and tokenize ``body`` exactly as a worker would (raises InvalidRequest)."""
    return gw.fleet.build_request(
        body.model,
        body.input_ids,
        text=body.text,
        request_id=body.request_id,
        top_k=body.output.top_k if "top_k" in body.output.model_fields_set else None,  # a default is no choice
        normalize=body.output.normalize,
        kind=body.output.kind,
        deadline_s=body.deadline_s,
        generation=body.output.generation,
    )


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


def _accepted(rid: str, status: RequestStatus = RequestStatus.QUEUED, warning: str | None = None) -> RequestAccepted:
    return RequestAccepted(request_id=rid, status=status, location=f"/v1/requests/{rid}", warning=warning)


def _no_worker(gw: Gateway, model: str | None) -> str | None:
    """Accepted all the same (a fleet scaled to zero starts on its queue), but said: no live worker serves it."""
    if model is None or gw.presence.has_worker(model):
        return None
    return no_worker_message(model, gw.settings.queue_for(model))


async def _no_worker_now(gw: Gateway, model: str | None) -> str | None:
    """:func:`_no_worker` on the event loop (the asyncio heartbeat reader)."""
    if model is None or await gw.apresence.has_worker(model):
        return None
    return no_worker_message(model, gw.settings.queue_for(model))


# -- endpoints -----------------------------------------------------------------------------------
router = APIRouter()
RequestId = Annotated[str, Path(pattern=REQUEST_ID_PATTERN, description="The ID returned at submission.")]
WaitS = Annotated[
    float | None,
    Query(ge=0, description="Long-poll: answer as soon as the result is stored, or after this many seconds with "
          "the current status (at most api.max_wait_s; default: answer at once)."),
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
    wait, applied = _submit_wait(gw, wait_s, prefer)
    if body.text is None and gw.fleet.model_loaded(body.model):  # no file, no Redis read: on the loop
        request = _build(gw, body)
    else:
        request = await run_in_threadpool(_build, gw, body)
    view: RequestView | None = None
    if wait and body.request_id is None:  # a new ID: subscribed before it is queued, nothing stored to read first
        key = gw.fleet.app.backend.get_key_for_task(request.request_id)
        async with gw.results.watching([key]) as watch:
            rid, status = await _queue(gw, request, rate_key, body)
            view = await view_when_published(gw, rid, watch, wait)
    else:
        rid, status = await _queue(gw, request, rate_key, body)
        if wait:  # a caller-given ID may be finished already: its result is read first
            view = await view_when_done(gw, rid, wait)
    headers = {"Location": f"/v1/requests/{rid}", **applied}
    if view is not None:
        return _json(view, 200, headers=headers)
    if wait:
        status = (await read_view(gw.fleet, gw.aredis, rid))[0].status  # the status at the end of the wait
    warning = await _no_worker_now(gw, request.model) if status is RequestStatus.QUEUED else None
    return _json(_accepted(rid, status, warning), 202, exclude_none=True, headers=headers)


def _submit_wait(gw: Gateway, wait_s: float | None, prefer: str | None) -> tuple[float, dict[str, str]]:
    """How long a submit waits for its result (s; 0 = not at all) and the headers that say so.

    ``wait_s`` over ``api.max_wait_s`` is refused (InvalidRequest naming ``wait_s``); ``Prefer: wait`` is a
    preference (RFC 7240): a longer one is cut to the limit, an unreadable one ignored."""
    if wait_s is not None:
        return _checked_wait(gw, wait_s), {}
    preferred = prefer_wait_s(prefer)
    if preferred is None:
        return 0.0, {}
    wait = min(preferred, gw.settings.api.max_wait_s)
    return wait, {"Preference-Applied": f"wait={wait:g}"}


def _checked_wait(gw: Gateway, wait_s: float) -> float:
    """``wait_s`` (a long-poll's bound, s), refused (InvalidRequest naming ``wait_s``) over ``api.max_wait_s``."""
    cap = gw.settings.api.max_wait_s
    if wait_s > cap:
        raise InvalidRequest(f"wait_s = {wait_s} exceeds the long-poll limit api.max_wait_s={cap}", "wait_s", cap)
    return wait_s


async def _queue(gw: Gateway, request: InferenceRequest, rate_key: str, body: SubmitBody) -> tuple[str, RequestStatus]:
    """Queue ``request``: with the others that arrive meanwhile (no caller-given ID, ``api.group_submits``), or
    alone; its ID and status (a caller-given ID's real one)."""
    if body.request_id is None and gw.settings.api.group_submits:
        item = SubmitItem([request], rate_key, [body.routing_key])
        return (await gw.submits.submit(item))[0], RequestStatus.QUEUED
    return await run_in_threadpool(_send_one, gw, request, rate_key, body)


def _send_one(gw: Gateway, request: InferenceRequest, rate_key: str, body: SubmitBody) -> tuple[str, RequestStatus]:
    """``FleetClient.send`` (blocking: in a thread): the request's ID and, for a caller-given ID, its real status."""
    rid = gw.fleet.send(request, rate_key=rate_key, routing_key=body.routing_key)
    return rid, gw.fleet.status(rid) if body.request_id else RequestStatus.QUEUED


@router.post("/v1/requests:batch", status_code=202, response_model=BatchAccepted, response_model_exclude_none=True,
             tags=["requests"])
def submit_batch(body: BatchSubmitBody, rate_key: CallerDep, gw: GatewayDep) -> BatchAccepted | JSONResponse:
    """Queue many requests, all or none: each is validated, every request ID checked (one ID names one
    body, inside the batch too) and the batch admitted before anything is queued; then the whole batch
    is queued in one Redis step. A known ID with the same body answers that request's real status."""
    cap = gw.settings.api.max_batch_requests
    if len(body.requests) > cap:
        msg = f"batch has {len(body.requests)} requests; the limit is api.max_batch_requests={cap}"
        return _error(413, InvalidRequest(msg, "requests", cap).to_payload())
    built = []
    for i, item in enumerate(body.requests):
        try:
            built.append(_build(gw, item))
        except InvalidRequest as exc:
            field = f"requests[{i}].{exc.field}"
            raise type(exc)(f"requests[{i}]: {exc.message}", field, exc.limit) from exc
    one_body_per_id([str(r.request_id) for r in built], [request_fingerprint(r) for r in built],
                    lambda i: f"requests[{i}]")  # a batch naming one ID twice is refused before admission  # fmt: skip
    for model, count in Tally(r.model for r in built).items():
        gw.fleet.admission.check_queue(model, count)
    gw.fleet.admission.take_rate(rate_key, len(built))
    sent = gw.fleet.send_batch(built, routing_keys=[item.routing_key for item in body.requests])
    statuses = [gw.fleet.status(rid) if item.request_id else RequestStatus.QUEUED
                for rid, item in zip(sent, body.requests, strict=True)]
    return BatchAccepted(
        requests=[
            _accepted(rid, status, _no_worker(gw, r.model) if status is RequestStatus.QUEUED else None)
            for rid, status, r in zip(sent, statuses, built, strict=True)
        ]
    )


@router.get("/v1/requests/{request_id}", response_model=RequestView, tags=["requests"])
async def get_request(request_id: RequestId, _: CallerDep, gw: GatewayDep, wait_s: WaitS = None) -> Response:
    """Where the request stands, with its result or error once it has one (and, while it is queued for a
    model no live worker serves, a ``warning`` that says so).

    ``wait_s`` (s, up to ``api.max_wait_s``; a larger value is a 422 naming the limit): wait for the
    result on the event loop (:func:`gateway.outcomes.await_outcomes`, no thread per waiter) and answer
    as soon as it is stored, else at ``wait_s`` with the status then.
    """
    if wait_s is not None:
        _checked_wait(gw, wait_s)
    if wait_s:
        view, model = await long_polled_view(gw, request_id, wait_s)
    else:
        view, model = await read_view(gw.fleet, gw.aredis, request_id)
    warning = await _no_worker_now(gw, model) if view.status is RequestStatus.QUEUED else None
    return _json(view.model_copy(update={"warning": warning}) if warning else view)


@router.delete(
    "/v1/requests/{request_id}",
    response_model=RequestView,
    tags=["requests"],
    responses={409: {"model": ErrorBody, "description": "it finished (a one-step request whose batch had started)"}},
)
def cancel(request_id: RequestId, _: CallerDep, gw: GatewayDep) -> RequestView | JSONResponse:
    """Cancel a queued request, a one-step request waiting in a worker's batch window, or a running generation;
    409 when it finished (a one-step request whose batch had started when the cancel came ends with its result).

    A running generation is answered once it has stopped (within a decode step): its view is then
    ``succeeded`` with ``finish_reason`` ``cancelled`` and the tokens made so far."""
    status = gw.fleet.status(request_id)
    if status is RequestStatus.NOT_FOUND:
        raise RequestNotFound(f"no request {request_id!r} is known", "request_id", None)
    if status is not RequestStatus.CANCELLED and not gw.fleet.cancel(request_id, settle_s=CANCEL_SETTLE_S):
        now = gw.fleet.status(request_id).value
        msg = (f"request {request_id} is {now}: only a request that has not run, or a running generation, "
               "can be cancelled")
        return _error(409, error_payload("conflict", "Conflict", msg, "request_id"))
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
async def stream(request_id: RequestId, _: CallerDep, gw: GatewayDep) -> Response:
    """A generation's events as they are produced (protocol.streams.StreamEvent JSON, one per frame).

    From its first token (a stream opened before the worker starts waits for it), each token index
    once, then ``final`` (finish_reason, usage) or ``error``. Leaving does not cancel the request:
    ``DELETE /v1/requests/{id}`` does.
    """
    marker, has_stream, has_result = await _stream_facts(gw, request_id)
    if marker is None and not has_stream:
        raise RequestNotFound(f"no request {request_id!r} is known (never submitted, or expired)", "request_id", None)
    kind = marker.get("kind") if marker else None
    if (kind not in (None, "generate")) or (has_result and not has_stream):
        what = (f"a {kind} request" if kind not in (None, "generate")
                else "finished and has no stream (it asked for stream: false, or ended before it ran: cancelled "
                "or expired)")  # fmt: skip
        msg = f"request {request_id} is {what}: only generations stream; GET /v1/requests/{request_id} has its result"
        return _error(409, error_payload("conflict", "Conflict", msg, "request_id"))
    return EventStream(_native_frames(gw, request_id))


async def _stream_facts(gw: Gateway, request_id: str) -> tuple[dict[str, Any] | None, bool, bool]:
    """The submit marker (None when unknown), whether the stream exists, whether the result is stored.

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
            raw, has_stream, has_result = await pipe.execute()
        if has_stream or not has_result or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.05)
    try:
        marker = json.loads(raw) if raw else None
    except ValueError:
        marker = {}
    return (marker if isinstance(marker, dict) or marker is None else {}), bool(has_stream), bool(has_result)


async def _native_frames(gw: Gateway, request_id: str) -> AsyncIterator[bytes]:
    try:
        async for batch in relay_event_batches(gw, request_id):  # ends from the stored result if events were lost
            yield b"".join(sse_frame(event.model_dump(mode="json", exclude_none=True)) for event in batch)
    except (FleetError, redis.RedisError) as exc:  # silence past WAIT_S, an unreadable entry, Redis trouble
        err = relay_error(exc, request_id)
        error = StreamEvent(type="error", index=0, error=type(err).__name__, message=err.message, field=err.field)
        yield sse_frame(error.model_dump(mode="json", exclude_none=True))


@router.api_route("/healthz", methods=["GET", "HEAD"], tags=["ops"])
async def healthz() -> dict[str, str]:
    """The process is alive (checks nothing else)."""
    return {"status": "ok"}


@router.api_route("/health", methods=["GET", "HEAD"], tags=["ops"], response_class=Response,
                  responses={200: {"description": "empty body"}})
async def health() -> Response:
    """Liveness under the name vLLM serves and guidellm (and other OpenAI-server tooling) probe: 200 with
    an empty body while the process answers HTTP, like ``/healthz``. It says nothing about Redis or
    workers: ``/readyz`` does."""
    return Response(status_code=200)


@router.api_route("/readyz", methods=["GET", "HEAD"], tags=["ops"],
                  responses={503: {"description": "not ready; 'problems' says why"}})
def readyz(
    gw: GatewayDep,
    model: Annotated[list[str] | None, Query(description="Only these models need a worker (default: all).")] = None,
) -> JSONResponse:
    """Ready when Redis answers and every configured model (or each ``model`` given) has a ready worker.

    Open to anyone, so a Redis failure is said without its address, user or error text (logged instead)."""
    wanted = None if model is None else [_model_key_or_name(gw.settings, m) for m in model]
    state = read_fleet_state(gw.settings, gw.fleet.redis)
    if state.redis_error:
        log.warning("not ready: %s", state.redis_error)
        return JSONResponse({"ready": False, "problems": [REDIS_DOWN_PROBLEM]}, status_code=503)
    problems = readiness_problems(state, wanted)
    return JSONResponse({"ready": not problems, "problems": problems}, status_code=503 if problems else 200)


@router.get("/metrics", tags=["ops"], response_class=Response)
def prometheus(gw: GatewayDep) -> Response:
    """Prometheus text format: gateway requests by route/status, latencies, queue depths."""
    return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: FleetSettings, client: FleetClient | None = None, *, access_log: bool = False,
               freeze_gc: bool = False) -> FastAPI:  # fmt: skip
    """The gateway app for ``settings``; it owns ``client`` (default: a new one) and closes it at shutdown.

    ``access_log``: log one line per request on ``fleet.access``, with its request ID (what
    :func:`serve` turns on with ``log.format: json``, in place of uvicorn's access log). ``freeze_gc``:
    at start-up, freeze the process's objects out of the garbage collector (:mod:`protocol.process_gc`;
    :func:`serve` does, the app owning its process).
    """
    gateway = Gateway(settings, client or FleetClient(settings))
    if not settings.api.api_keys:
        log.warning("api.api_keys is empty: /v1/* answers without an API key (set FLEET_API__API_KEYS)")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if freeze_gc:  # a full collection would stop every request (protocol.process_gc)
            freeze_startup_objects(log, "gateway")
        yield
        await gateway.aclose()

    # Swagger UI and ReDoc from the assets fastapi-offline vendors (served under /static-offline-docs),
    # never from a CDN: /docs works where the gateway cannot reach the internet.
    app = FastAPIOffline(
        lifespan=lifespan,
        title="onnx-fleet gateway",
        version="1",
        description="Queue inference requests for the onnx-fleet workers and poll their results by ID; "
        "OpenAI-compatible completions, chat completions, embeddings and models under /v1.",
        responses=ERROR_RESPONSES,
    )
    app.state.gateway = gateway
    app.include_router(router)
    app.include_router(openai_router)
    app.include_router(responses_router)
    # outermost last: metrics (counts every refusal), then the key and Content-Type (before any body
    # is read), the byte cap, and the JSON's shape (before any body is parsed): see gateway.body_guard
    app.add_middleware(JsonShapeMiddleware, bounds=bounds_for(settings))
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.api.max_body_bytes)
    app.add_middleware(RequestGuardMiddleware, keys=gateway.keys)
    app.add_middleware(MetricsMiddleware, metrics=gateway.metrics)
    if access_log:
        app.add_middleware(AccessLogMiddleware)
    install_error_handlers(app)
    return app


def _model_key_or_name(settings: FleetSettings, name: str) -> str:
    try:
        return settings.model_key(name)
    except UnknownModel:
        return name


def serve(
    settings: FleetSettings,
    *,
    host: str | None = None,
    port: int | None = None,
    log_level: str = "info",
    access_log: bool = True,
) -> None:
    """Run the gateway with uvicorn until interrupted (one process; run more for replicas).

    With ``log.format: json`` every line (uvicorn's, the fleet's, the access log) is one JSON object
    on stderr (:mod:`protocol.log_format`), and the access log is the fleet's own (with request IDs). With
    ``text`` uvicorn keeps its own lines and handlers, and the fleet's are text lines on stderr.
    """
    import uvicorn

    from gateway.request_heads import BoundedHeadProtocol  # imports uvicorn's protocol: only when serving

    json_logs = settings.log.format == "json"
    logging_kwargs: dict[str, Any] = {}
    configure_logging(settings.log.format, log_level.upper())  # the fleet's own lines (fleet.api…), in text too
    if json_logs:
        logging_kwargs["log_config"] = None  # uvicorn's loggers propagate to the JSON root handler
    uvicorn.run(
        create_app(settings, access_log=access_log and json_logs, freeze_gc=True),
        host=host or settings.api.host,
        port=port or settings.api.port,
        log_level=log_level,
        access_log=access_log and not json_logs,
        proxy_headers=False,
        http=BoundedHeadProtocol,  # request heads bounded in bytes, header count and time (gateway.request_heads)
        **logging_kwargs,
    )
