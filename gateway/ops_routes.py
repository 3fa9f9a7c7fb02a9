"""The operations routes (tag ``ops``), open without an API key: liveness (``/healthz``, and ``/health``
as vLLM names it), readiness (``/readyz``: Redis reachable and a ready worker per model; for a model without
one, each of its live workers is named with why it is not ready, in the words of its heartbeat's ``not_ready``)
and the Prometheus text at ``/metrics``. The whole API: :mod:`gateway.app`.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.deps import GatewayDep
from producer.registry import FleetState, read_fleet_state, readiness_problems
from producer.worker_readiness import not_ready_reasons
from protocol.errors import UnknownModel
from protocol.settings import FleetSettings, no_models_configured

__all__ = ["NO_MODELS_PROBLEM", "REDIS_DOWN_PROBLEM", "health", "healthz", "log_no_models", "prometheus", "readyz",
           "router"]

log = logging.getLogger("fleet.api")

REDIS_DOWN_PROBLEM = "the queue (Redis) is unreachable (the gateway's log says why)"
"""What ``/readyz`` says of a Redis it cannot reach (the address and the error stay in the log)."""
NO_MODELS_PROBLEM = "no models configured (the gateway's log names the config file it read, or says it read none)"
"""What ``/readyz`` says when the settings configure no model, as ``fleet probe ready`` fails then
(:func:`protocol.settings.no_models_configured`, whose words name the file and the working directory: they stay in the
log, logged once by :func:`log_no_models`)."""

router = APIRouter()


@router.get("/healthz", tags=["ops"])
async def healthz() -> dict[str, str]:
    """The process is alive (checks nothing else)."""
    return {"status": "ok"}


@router.get("/health", tags=["ops"], response_class=Response, responses={200: {"description": "empty body"}})
async def health() -> Response:
    """Liveness under the name vLLM serves and guidellm (and other OpenAI-server tooling) probe: 200 with
    an empty body while the process answers HTTP, like ``/healthz``. It says nothing about Redis or
    workers: ``/readyz`` does."""
    return Response(status_code=200)


@router.get("/readyz", tags=["ops"], responses={503: {"description": "not ready; 'problems' says why"}})
def readyz(
    gw: GatewayDep,
    model: Annotated[list[str] | None, Query(description="Only these models need a worker (default: all).")] = None,
) -> JSONResponse:
    """Ready when Redis answers and every configured model (or each ``model`` given) has a ready worker. Settings
    that configure no model are not ready (``no models configured``, as ``fleet probe ready`` fails then).

    ``problems`` names each model without a ready worker, then each of its live workers that is not ready and why
    (as ``fleet probe ready --worker`` says it: shutting down, a dead thread, an engine failing every run, a
    stall, or still loading). Open to anyone, so a Redis failure is said without its address, user or error text
    (logged instead)."""
    if model is None and not gw.settings.models:  # else ready: every one of no models has a ready worker
        return JSONResponse({"ready": False, "problems": [NO_MODELS_PROBLEM]}, status_code=503)
    wanted = None if model is None else [_model_key_or_name(gw.settings, m) for m in model]
    state = read_fleet_state(gw.settings, gw.fleet.redis)
    if state.redis_error:
        log.warning("not ready: %s", state.redis_error)
        return JSONResponse({"ready": False, "problems": [REDIS_DOWN_PROBLEM]}, status_code=503)
    problems = readiness_problems(state, wanted) + _workers_not_ready(state, wanted)
    return JSONResponse({"ready": not problems, "problems": problems}, status_code=503 if problems else 200)


# Load balancers that probe with HEAD get the GET answer without its body (uvicorn drops it). Routes of their
# own, out of the schema: one route with both methods gave /openapi.json two operations of one ID, in an order
# that changed from process to process.
for _path, _endpoint in (("/healthz", healthz), ("/health", health), ("/readyz", readyz)):
    router.add_api_route(_path, _endpoint, methods=["HEAD"], include_in_schema=False)


@router.get("/metrics", tags=["ops"], response_class=Response)
def prometheus(gw: GatewayDep) -> Response:
    """Prometheus text format: gateway requests by route/status, latencies, queue depths."""
    return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)


def log_no_models(settings: FleetSettings) -> None:
    """Log, once at start-up, why ``/readyz`` will answer :data:`NO_MODELS_PROBLEM` (nothing when models are
    configured)."""
    if not settings.models:
        log.warning("%s: /readyz answers 503 until the gateway is started with models", no_models_configured(settings))


def _workers_not_ready(state: FleetState, wanted: list[str] | None) -> list[str]:
    """Why each live worker of a model in ``wanted`` (None: every configured model) that has no ready worker is
    not ready; a model with a ready worker needs none of its other workers."""
    return [reason for m in state.models
            if (wanted is None or m.name in wanted) and m.ready_workers == 0
            for reason in not_ready_reasons(m.workers)]  # fmt: skip


def _model_key_or_name(settings: FleetSettings, name: str) -> str:
    try:
        return settings.model_key(name)
    except UnknownModel:
        return name
