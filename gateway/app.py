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
    GET    /readyz[?model=m]          200 | 503           Redis reachable, >= 1 model, >= 1 ready worker per model
    GET    /metrics                   200                 Prometheus text (plain, no auth)
    GET    /docs, /openapi.json                           OpenAPI

``/v1/*`` needs an API key when ``api.api_keys`` is set, in header ``X-API-Key`` or
``Authorization: Bearer`` (missing or wrong → 401); a request is the key's that submitted it: to another key
its ``GET``, ``/stream`` and ``DELETE`` answer 404 and its ``request_id`` 409 (:mod:`gateway.request_owners`).
Native errors are JSON ``{"error", "type", "message", "field", "limit"}``, OpenAI routes answer in OpenAI's
error shape (:mod:`gateway.errors`; ``/v1`` and paths with ``//`` too):
413 body over ``api.max_body_bytes`` or a batch over ``api.max_batch_requests``; 422 invalid input
(e.g. more tokens than ``max_input_tokens``); 429 + ``Retry-After`` from admission control; 503 Redis down.
No path is redirected: one with a trailing slash or a ``//`` is a 404 naming the route it means, never a 307 that a
client may follow without the POST's body.
Open without a key: the probes, ``/metrics``, ``/docs``, ``/redoc``, ``/openapi.json``. Before any of it, a request
head is bounded in bytes, header lines and time (:mod:`gateway.request_heads`: 431, 408).
Native endpoints that touch Redis are plain ``def`` (FastAPI's thread pool); those that wait for
results or streams are ``async`` on redis.asyncio, so an open stream costs no thread.
Where each part lives (this module re-exports their public names): the ``/v1/requests`` routes in
:mod:`gateway.requests_routes` (submit steps: :mod:`gateway.native_submit`), the probes and ``/metrics`` in
:mod:`gateway.ops_routes`, the OpenAI routes in :mod:`gateway.openai_routes` and :mod:`gateway.responses_routes`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi_offline import FastAPIOffline

from gateway.body_guard import JsonShapeMiddleware, RequestGuardMiddleware, bounds_for
from gateway.concurrency_cap import ConcurrencyCapMiddleware
from gateway.deps import Gateway
from gateway.errors import ERROR_RESPONSES, install_error_handlers
from gateway.middleware import AccessLogMiddleware, BodyLimitMiddleware, MetricsMiddleware
from gateway.openai_routes import router as openai_router
from gateway.ops_routes import REDIS_DOWN_PROBLEM, health, healthz, log_no_models, prometheus, readyz
from gateway.ops_routes import router as ops_router
from gateway.pool_sweeper import PoolSweeper
from gateway.requests_routes import (
    STREAM_GRACE_S,
    PreferHeader,
    RequestId,
    WaitS,
    cancel,
    get_request,
    stream,
    submit,
    submit_batch,
)
from gateway.requests_routes import router as requests_router
from gateway.responses_routes import router as responses_router
from producer.client import FleetClient
from protocol.log_format import configure_logging
from protocol.process_gc import freeze_startup_objects
from protocol.settings import FleetSettings

__all__ = [
    "REDIS_DOWN_PROBLEM",
    "STREAM_GRACE_S",
    "PreferHeader",
    "RequestId",
    "WaitS",
    "cancel",
    "create_app",
    "get_request",
    "health",
    "healthz",
    "prometheus",
    "readyz",
    "router",
    "serve",
    "stream",
    "submit",
    "submit_batch",
]

log = logging.getLogger("fleet.api")

router = APIRouter()
"""The native API: the ``/v1/requests`` routes, then the probes and ``/metrics`` (the order /docs lists them in)."""
router.include_router(requests_router)
router.include_router(ops_router)


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
    log_no_models(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if freeze_gc:  # a full collection would stop every request (protocol.process_gc)
            freeze_startup_objects(log, "gateway")
        sweeper = PoolSweeper([gateway.aredis.connection_pool])  # idle pools too, after a Redis restart
        sweeper.start()
        try:
            yield
        finally:
            await sweeper.aclose()
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
        redirect_slashes=False,  # a path that is no route is a 404 in its prefix's shape, never a 307 (gateway.errors)
    )
    app.state.gateway = gateway
    app.include_router(router)
    app.include_router(openai_router)
    app.include_router(responses_router)
    # outermost last: metrics (counts every refusal), the bound on requests answered at once
    # (gateway.concurrency_cap), then the key and Content-Type (before any body is read), the byte cap and the
    # body's deadline (a stalled body gives its slot back), and the JSON's shape (before any body is parsed): see
    # gateway.body_guard
    app.add_middleware(JsonShapeMiddleware, bounds=bounds_for(settings))
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.api.max_body_bytes,
                       timeout_s=settings.api.body_timeout_s)  # fmt: skip
    app.add_middleware(RequestGuardMiddleware, keys=gateway.keys)
    app.add_middleware(ConcurrencyCapMiddleware, limit=settings.api.max_concurrent_requests, metrics=gateway.metrics)
    app.add_middleware(MetricsMiddleware, metrics=gateway.metrics)
    if access_log:
        app.add_middleware(AccessLogMiddleware)
    install_error_handlers(app)
    return app


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

    from gateway.request_heads import ConnectionLimits, bounded_protocol  # imports uvicorn's: only when serving

    api = settings.api
    limits = ConnectionLimits(api.max_head_bytes, api.max_headers, api.head_timeout_s, api.write_stall_s)
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
        http=bounded_protocol(limits),  # bounds on request heads and stalled readers (gateway.request_heads)
        **logging_kwargs,
    )

