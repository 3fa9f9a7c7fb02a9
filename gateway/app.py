"""The HTTP gateway (FastAPI): submit, poll, cancel; models, health, readiness, metrics.

::

    POST   /v1/requests           202 + Location      queue one request
    POST   /v1/requests:batch     202                 queue many (all or none)
    GET    /v1/requests/{id}      200 | 404           status + result or error
    DELETE /v1/requests/{id}      200 | 404 | 409     cancel a request that has not run
    GET    /v1/models             200                 configured models, versions, readiness
    GET    /healthz               200                 the process is alive
    GET    /readyz[?model=m]      200 | 503           Redis reachable and >= 1 ready worker per model
    GET    /metrics               200                 Prometheus text (plain, no auth)
    GET    /docs, /openapi.json                       OpenAPI

``/v1/*`` needs header ``X-API-Key`` when ``api.api_keys`` is set (missing or wrong → 401).
Errors are JSON ``{"error", "type", "message", "field", "limit"}``: 413 body over
``api.max_body_bytes`` or a batch over ``api.max_batch_requests``; 422 invalid input (e.g. more
tokens than ``max_input_tokens``); 429 + ``Retry-After`` from admission control; 503 Redis down.
Endpoints that touch Redis are plain ``def``: FastAPI runs them in its thread pool.
"""

from __future__ import annotations

import hmac
import logging
from collections import Counter as Tally
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import redis
from celery.result import AsyncResult
from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader
from kombu.exceptions import OperationalError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

from gateway.middleware import BodyLimitMiddleware, GatewayMetrics, MetricsMiddleware
from gateway.schema import (
    REQUEST_ID_PATTERN,
    BatchAccepted,
    BatchSubmitBody,
    ErrorBody,
    ModelInfo,
    ModelList,
    RequestAccepted,
    RequestView,
    SubmitBody,
)
from producer.admission import rate_key_for
from producer.client import FleetClient, RequestStatus
from producer.registry import read_fleet_state, readiness_problems
from protocol.errors import (
    AdmissionRefused,
    FleetError,
    InvalidRequest,
    RequestCancelled,
    RequestNotFound,
    UnknownModel,
    error_from_payload,
)
from protocol.messages import InferenceRequest, decode_result
from protocol.settings import FleetSettings

__all__ = ["create_app", "serve"]

log = logging.getLogger("fleet.api")

API_KEY_HEADER = "X-API-Key"
_api_key = APIKeyHeader(name=API_KEY_HEADER, auto_error=False, description="One of api.api_keys.")
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        401: "missing or wrong API key",
        413: "body or batch too large",
        422: "invalid request (names the field and the limit)",
        429: "refused by admission control; see Retry-After",
        503: "Redis unreachable",
    }.items()
}


class Gateway:
    """What every endpoint needs: settings, the client (Redis + Celery) and the metrics."""

    def __init__(self, settings: FleetSettings, fleet: FleetClient) -> None:
        self.settings = settings
        self.fleet = fleet
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry, settings, fleet.redis)
        self.keys = [k.encode() for k in settings.api.api_keys]

    def build(self, body: SubmitBody) -> InferenceRequest:
        """Validate and tokenize ``body`` exactly as a worker would (raises InvalidRequest)."""
        return self.fleet.build_request(
            body.model,
            body.input_ids,
            text=body.text,
            request_id=body.request_id,
            top_k=body.output.top_k,
            normalize=body.output.normalize,
            kind=body.output.kind,
            deadline_s=body.deadline_s,
        )


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]


def _caller(api_key: Annotated[str | None, Depends(_api_key)], gw: GatewayDep) -> str:
    """The caller's rate-limit bucket; 401 unless the key is one of api.api_keys (when any is set)."""
    if gw.keys and not (api_key and any(hmac.compare_digest(api_key.encode(), k) for k in gw.keys)):
        raise HTTPException(
            401,
            f"{'wrong' if api_key else 'missing'} API key: send header {API_KEY_HEADER} with one of "
            "the keys in api.api_keys",
            headers={"WWW-Authenticate": "ApiKey"},
        )
    return rate_key_for(api_key)


def _error(status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(payload, status_code=status, headers=headers)


def _payload(code: str, kind: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {"error": code, "type": kind, "message": message, "field": field, "limit": None}


def _accepted(rid: str) -> RequestAccepted:
    return RequestAccepted(request_id=rid, location=f"/v1/requests/{rid}")


# -- error handlers ------------------------------------------------------------------------------
def _on_fleet_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, FleetError)
    if isinstance(exc, AdmissionRefused):
        _gateway(request).metrics.refused.labels(exc.code).inc()
        return _error(429, exc.to_payload(), {"Retry-After": str(max(1, round(exc.retry_after_s)))})
    status = 422 if isinstance(exc, InvalidRequest) else 404 if isinstance(exc, RequestNotFound) else 500
    return _error(status, exc.to_payload())


def _on_invalid(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    more = f" (and {len(errs) - 1} more errors)" if len(errs) > 1 else ""
    return _error(422, InvalidRequest(f"invalid field {field}: {first['msg']}{more}", field).to_payload())


def _on_http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http")
    return _error(exc.status_code, _payload(code, "HTTPError", str(exc.detail)), dict(exc.headers or {}))


def _on_redis_down(_: Request, exc: Exception) -> JSONResponse:
    log.warning("Redis unreachable: %s", exc)
    msg = f"the queue (Redis) is unreachable: {type(exc).__name__}; retry later"
    return _error(503, _payload("unavailable", type(exc).__name__, msg), {"Retry-After": "5"})


# -- endpoints -----------------------------------------------------------------------------------
router = APIRouter()
CallerDep = Annotated[str, Depends(_caller)]
RequestId = Annotated[str, Path(pattern=REQUEST_ID_PATTERN, description="The ID returned at submission.")]


@router.post("/v1/requests", status_code=202, response_model=RequestAccepted, tags=["requests"])
def submit(body: SubmitBody, response: Response, rate_key: CallerDep, gw: GatewayDep) -> RequestAccepted:
    """Validate, admit and queue one request; poll ``Location`` for its result."""
    rid = gw.fleet.send(gw.build(body), rate_key=rate_key)
    response.headers["Location"] = f"/v1/requests/{rid}"
    return _accepted(rid)


@router.post("/v1/requests:batch", status_code=202, response_model=BatchAccepted, tags=["requests"])
def submit_batch(body: BatchSubmitBody, rate_key: CallerDep, gw: GatewayDep) -> BatchAccepted | JSONResponse:
    """Queue many requests: each is validated and admitted first, so all are queued or none."""
    cap = gw.settings.api.max_batch_requests
    if len(body.requests) > cap:
        msg = f"batch has {len(body.requests)} requests; the limit is api.max_batch_requests={cap}"
        return _error(413, InvalidRequest(msg, "requests", cap).to_payload())
    built = []
    for i, item in enumerate(body.requests):
        try:
            built.append(gw.build(item))
        except InvalidRequest as exc:
            field = f"requests[{i}].{exc.field}"
            raise type(exc)(f"requests[{i}]: {exc.message}", field, exc.limit) from exc
    for model, count in Tally(r.model for r in built).items():
        gw.fleet.admission.check_queue(model, count)
    gw.fleet.admission.take_rate(rate_key, len(built))
    return BatchAccepted(requests=[_accepted(gw.fleet.send(r, admit=False)) for r in built])


@router.get("/v1/requests/{request_id}", response_model=RequestView, tags=["requests"])
def get_request(request_id: RequestId, _: CallerDep, gw: GatewayDep) -> RequestView:
    """Where the request stands, with its result or error once it has one."""
    return _view(gw.fleet, request_id)


@router.delete(
    "/v1/requests/{request_id}",
    response_model=RequestView,
    tags=["requests"],
    responses={409: {"model": ErrorBody, "description": "it is running or already finished"}},
)
def cancel(request_id: RequestId, _: CallerDep, gw: GatewayDep) -> RequestView | JSONResponse:
    """Cancel a request that has not started; 409 when it is running or finished."""
    status = gw.fleet.status(request_id)
    if status is RequestStatus.NOT_FOUND:
        raise RequestNotFound(f"no request {request_id!r} is known", "request_id", None)
    if status is not RequestStatus.CANCELLED and not gw.fleet.cancel(request_id):
        now = gw.fleet.status(request_id).value
        msg = f"request {request_id} is {now}: only a request that has not started can be cancelled"
        return _error(409, _payload("conflict", "Conflict", msg, "request_id"))
    return _view(gw.fleet, request_id)


@router.get("/v1/models", response_model=ModelList, tags=["fleet"])
def models(_: CallerDep, gw: GatewayDep) -> ModelList:
    """Every configured model: versions served, ready workers, queue depth and cap."""
    state = read_fleet_state(gw.settings, gw.fleet.redis)
    if state.redis_error:
        raise redis.ConnectionError(state.redis_error)
    return ModelList(
        models=[
            ModelInfo(
                name=m.name,
                queue=m.queue,
                version=m.configured_version,
                served_versions=m.versions,
                ready=m.ready_workers > 0,
                ready_workers=m.ready_workers,
                workers=len(m.workers),
                queue_depth=m.depth,
                max_queue_depth=m.max_queue_depth,
                max_input_tokens=gw.settings.models[m.name].limits.max_input_tokens,
            )
            for m in state.models
        ]
    )


@router.get("/healthz", tags=["ops"])
async def healthz() -> dict[str, str]:
    """The process is alive (checks nothing else)."""
    return {"status": "ok"}


@router.get("/readyz", tags=["ops"], responses={503: {"description": "not ready; 'problems' says why"}})
def readyz(
    gw: GatewayDep,
    model: Annotated[list[str] | None, Query(description="Only these models need a worker (default: all).")] = None,
) -> JSONResponse:
    """Ready when Redis answers and every configured model (or each ``model`` given) has a ready worker."""
    wanted = None if model is None else [_model_key_or_name(gw.settings, m) for m in model]
    problems = readiness_problems(read_fleet_state(gw.settings, gw.fleet.redis), wanted)
    return JSONResponse({"ready": not problems, "problems": problems}, status_code=503 if problems else 200)


@router.get("/metrics", tags=["ops"], response_class=Response)
def prometheus(gw: GatewayDep) -> Response:
    """Prometheus text format: gateway requests by route/status, latencies, queue depths."""
    return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: FleetSettings, client: FleetClient | None = None) -> FastAPI:
    """The gateway app for ``settings``; it owns ``client`` (default: a new one) and closes it at shutdown."""
    gateway = Gateway(settings, client or FleetClient(settings))
    if not settings.api.api_keys:
        log.warning("api.api_keys is empty: /v1/* answers without an API key (set FLEET_API__API_KEYS)")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        gateway.fleet.close()

    app = FastAPI(
        lifespan=lifespan,
        title="onnx-fleet gateway",
        version="1",
        description="Queue inference requests for the onnx-fleet workers and poll their results by ID.",
        responses=ERRORS,
    )
    app.state.gateway = gateway
    app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.api.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=gateway.metrics)  # outermost: counts 413s too
    app.add_exception_handler(FleetError, _on_fleet_error)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(HTTPException, _on_http)
    app.add_exception_handler(redis.RedisError, _on_redis_down)
    app.add_exception_handler(OperationalError, _on_redis_down)
    return app


def _model_key_or_name(settings: FleetSettings, name: str) -> str:
    try:
        return settings.model_key(name)
    except UnknownModel:
        return name


def _view(fleet: FleetClient, request_id: str) -> RequestView:
    """The request's status, plus its result or error, read without blocking."""
    status = fleet.status(request_id)
    if status is RequestStatus.NOT_FOUND:
        raise RequestNotFound(f"no request {request_id!r} is known (never submitted, or expired)", "request_id", None)
    view = RequestView(request_id=request_id, status=status)
    if status in (RequestStatus.QUEUED, RequestStatus.RUNNING):
        return view
    # AsyncResult.result reads the stored meta once; .get() would subscribe, which is not thread-safe
    value = AsyncResult(request_id, app=fleet.app).result
    if status is RequestStatus.SUCCEEDED:
        return view.model_copy(update={"result": decode_result(value).model_dump(mode="json")})
    err: FleetError
    if isinstance(value, FleetError):
        err = value
    elif status is RequestStatus.CANCELLED:  # revoked (Celery stores TaskRevokedError) or cancel-marked
        err = RequestCancelled(f"request {request_id} was cancelled before it ran", "request_id", None)
    elif isinstance(value, BaseException):
        err = error_from_payload(type(value).__name__, value.args)
    else:
        err = FleetError(f"request {request_id} failed: {value!r}", None, None)
    return view.model_copy(update={"error": ErrorBody(**err.to_payload())})


def serve(
    settings: FleetSettings,
    *,
    host: str | None = None,
    port: int | None = None,
    log_level: str = "info",
    access_log: bool = True,
) -> None:
    """Run the gateway with uvicorn until interrupted (one process; run more for replicas)."""
    import uvicorn

    uvicorn.run(
        create_app(settings),
        host=host or settings.api.host,
        port=port or settings.api.port,
        log_level=log_level,
        access_log=access_log,
        proxy_headers=False,
    )
