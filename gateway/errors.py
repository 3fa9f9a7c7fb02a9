"""Error responses of the gateway, in the shape of the route that failed.

* Native routes: ``{"error": code, "type": class, "message", "field", "limit"}`` (:class:`ErrorBody`).
* OpenAI routes (:func:`is_openai_path`): ``{"error": {"message", "type", "param", "code"}}``, where
  ``type`` is OpenAI's family (``invalid_request_error``, ``authentication_error``,
  ``rate_limit_error``, ``timeout_error``, ``server_error``), ``param`` the field that broke a
  limit and ``code`` the fleet's error code (``queue_full``, ``no_worker``, …), except a prompt past the
  model's limit: OpenAI's ``context_length_exceeded`` (the fleet's ``input_too_long`` on native routes).

Status codes: invalid input 422 on native routes and 400 on OpenAI ones (an unknown model: 404 there,
as OpenAI answers); 400 on both a JSON body whose object repeats a key (``duplicate_key``, naming its path:
:mod:`gateway.body_guard`); 401 bad key; 404 unknown request; 409 cancelled, or a known request ID sent again
with another body; 413 body too large (bytes, or structure: :mod:`gateway.body_guard`); 415 a body not
declared JSON; 431 a request head over its bounds, 408 one not sent in time (:mod:`gateway.request_heads`,
before routing) or a body not sent within ``api.body_timeout_s`` (:mod:`gateway.middleware`, naming ``body``);
429 admission (+ ``Retry-After``); 503 Redis down (said without its address) or over
``api.max_concurrent_requests`` (:mod:`gateway.concurrency_cap`); 504 no result in time (the request may
still finish: poll ``GET /v1/requests/{id}`` with the ``X-Request-ID`` header's value).
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError
from starlette.exceptions import HTTPException
from starlette.routing import Match

from gateway.invalid_fields import describe
from gateway.schema import ErrorBody
from protocol.errors import (
    AdmissionRefused,
    FleetError,
    IdempotencyConflict,
    InvalidRequest,
    NoLiveWorker,
    RequestCancelled,
    RequestExpired,
    RequestNotFound,
    ResultTimeout,
    SubmitInterrupted,
    UnknownModel,
)
from protocol.messages import limit_of

__all__ = [
    "ERROR_RESPONSES",
    "OPENAI_PATHS",
    "error_payload",
    "fleet_error_response",
    "install_error_handlers",
    "is_openai_path",
    "is_v1_path",
    "openai_error",
    "openai_error_of",
    "relay_error",
    "status_of",
]

log = logging.getLogger("fleet.api")

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        400: "a JSON body whose object repeats a key (field: the key's path, e.g. messages[0].role)",
        401: "missing or wrong API key",
        408: "a request body not complete within api.body_timeout_s (the connection is closed)",
        413: "body or batch too large, or a JSON body too deeply nested or with too many arrays/objects/strings",
        415: "a body not sent as Content-Type: application/json",
        422: "invalid request (names the field and the limit)",
        429: "refused by admission control; see Retry-After",
        503: "Redis unreachable, or the gateway already answers api.max_concurrent_requests requests",
    }.items()
}
"""The errors every native route may answer with, for the OpenAPI document."""

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models")
"""Routes that answer in OpenAI's shapes (``/v1/models/{model}`` and ``/v1/responses...`` included)."""

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    429: "rate_limit_error",
    504: "timeout_error",
}
_OPENAI_CODES = {"input_too_long": "context_length_exceeded"}
"""Fleet error codes OpenAI names otherwise: clients (LangChain, LiteLLM, the SDKs' users) test for OpenAI's
``context_length_exceeded`` to trim a prompt and retry. Every other code is the fleet's own."""


_SLASHES = re.compile(r"/{2,}")
NATIVE_V1_PREFIX = "/v1/requests"
"""The fleet's own routes under ``/v1`` (``/v1/requests``, ``:batch``, ``/{id}``, ``/{id}/stream``); every other
``/v1/...`` path is OpenAI's namespace."""


def _collapsed(path: str) -> str:
    """``path`` with each run of slashes as one (``//v1/models`` → ``/v1/models``): no route is at such a path
    (it answers 404), but it belongs to the namespace it reads as."""
    return _SLASHES.sub("/", path) if "//" in path else path


def is_v1_path(path: str) -> bool:
    """``/v1`` and every ``/v1/...`` path (``//v1/...`` too): the API that needs a key (:mod:`gateway.body_guard`)."""
    path = _collapsed(path)
    return path == "/v1" or path.startswith("/v1/")


def is_openai_path(path: str) -> bool:
    """True for the OpenAI-compatible routes, and for any other ``/v1`` path but the fleet's own
    (:data:`NATIVE_V1_PREFIX`), ``/v1`` itself and paths with ``//`` included: an OpenAI SDK that calls a route
    the fleet lacks (``/v1/files``, ``/v1/audio/speech``, ``/v1/models/`` with a trailing slash) reads the 404 in
    its own shape (before, the native one: the SDK's error then carried the whole body as its message)."""
    path = _collapsed(path)
    if path in OPENAI_PATHS or path.startswith(("/v1/models/", "/v1/responses")):
        return True
    return is_v1_path(path) and not path.startswith(NATIVE_V1_PREFIX)


def openai_error(status: int, payload: dict[str, Any]) -> dict[str, Any]:
    """A native error payload in OpenAI's shape."""
    kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    code = _OPENAI_CODES.get(payload["error"], payload["error"])
    error = {"message": payload["message"], "type": kind, "param": payload.get("field"), "code": code}
    return {"error": error}


def openai_error_of(exc: FleetError) -> dict[str, Any]:
    """``exc`` in OpenAI's shape (its ``type`` from the status it would answer with)."""
    return openai_error(status_of(exc, openai=True), exc.to_payload())


def relay_error(exc: Exception, request_id: str) -> FleetError:
    """What a stream relay reports when reading the stream failed: ``exc`` itself when it is a FleetError
    (silence past the wait, an unreadable entry), else Redis trouble, pointing at the ID to poll."""
    if isinstance(exc, FleetError):
        return exc
    log.warning("Redis failed while streaming %s: %s", request_id, exc)  # its address: for the log, not the caller
    msg = (f"the queue (Redis) failed while streaming {request_id}: {type(exc).__name__}; "
           f"poll GET /v1/requests/{request_id}")  # fmt: skip
    return FleetError(msg, "stream", None)


def error_payload(code: str, kind: str, message: str, field: str | None = None, limit: Any = None) -> dict[str, Any]:
    """A native error payload."""
    return {"error": code, "type": kind, "message": message, "field": field, "limit": limit}


def status_of(exc: FleetError, *, openai: bool) -> int:
    """The HTTP status of a FleetError on a native (``openai`` False) or OpenAI route."""
    if isinstance(exc, AdmissionRefused):
        return 429
    if isinstance(exc, UnknownModel) and openai:
        return 404
    if isinstance(exc, InvalidRequest):
        return 400 if openai else 422
    if isinstance(exc, RequestNotFound):
        return 404
    if isinstance(exc, RequestCancelled | IdempotencyConflict):
        return 409
    if isinstance(exc, NoLiveWorker):  # nothing serves the model yet: unavailable, not slow
        return 503
    if isinstance(exc, ResultTimeout | RequestExpired):
        return 504
    return 500


def _respond(
    request: Request, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None
) -> JSONResponse:
    body = openai_error(status, payload) if is_openai_path(request.url.path) else payload
    return JSONResponse(body, status_code=status, headers=headers)


def fleet_error_response(exc: FleetError, *, openai: bool, headers: dict[str, str] | None = None) -> JSONResponse:
    """The response for ``exc`` (``Retry-After`` added for admission refusals)."""
    status = status_of(exc, openai=openai)
    extra = dict(headers or {})
    if isinstance(exc, AdmissionRefused):
        extra["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    payload = exc.to_payload()
    return JSONResponse(openai_error(status, payload) if openai else payload, status_code=status, headers=extra)


def _on_fleet_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, FleetError)
    if isinstance(exc, AdmissionRefused):
        request.app.state.gateway.metrics.refused.labels(exc.code).inc()
    return fleet_error_response(exc, openai=is_openai_path(request.url.path))


def _on_invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        err = InvalidRequest(_json_error_message(first, exc.body), "body", "JSON")
        return fleet_error_response(err, openai=is_openai_path(request.url.path))
    field, message = describe(errs)
    err = InvalidRequest(message, field, limit_of(first))
    return fleet_error_response(err, openai=is_openai_path(request.url.path))


def _json_error_message(error: Any, body: Any) -> str:
    """'body is not valid JSON: <why> at line L column C' from FastAPI's json_invalid error (its loc
    holds a character offset, which is not a field)."""
    loc = error.get("loc", ())
    offset = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
    why = (error.get("ctx") or {}).get("error") or error.get("msg", "JSON decode error")
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body if isinstance(body, str) else None
    if offset is None or text is None:
        return f"body is not valid JSON: {why}"
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"body is not valid JSON: {why} at line {line} column {column} (character {offset})"


def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    cause = exc.__cause__
    if exc.status_code == 400 and cause is not None:  # FastAPI's "error parsing the body", and why
        return fleet_error_response(_unparsable_body(cause), openai=is_openai_path(request.url.path))
    code = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http")
    message = str(exc.detail)
    if exc.status_code == 404 and message == "Not Found":  # Starlette's router: no route at the path
        message = _no_route_message(request)
    payload = error_payload(code, "HTTPError", message)
    return _respond(request, exc.status_code, payload, dict(exc.headers or {}))


def _no_route_message(request: Request) -> str:
    """The router's 404 message, naming the route a path with a trailing slash or a ``//`` means (``/v1/models/``):
    the gateway redirects no path (``redirect_slashes`` off: a 307 to an OpenAI SDK, or to a client that drops a
    POST's body on a redirect, was no answer)."""
    path = request.scope["path"]
    route_path = _collapsed(path).rstrip("/") or "/"
    if route_path == path:
        return "Not Found"
    scope = {**request.scope, "path": route_path}
    if not any(route.matches(scope)[0] is not Match.NONE for route in request.app.router.routes):
        return "Not Found"
    return f"Not Found: no route is at {path[:200]}; the route is {route_path} (paths are not redirected)"


def _unparsable_body(cause: BaseException) -> InvalidRequest:
    """Why a body FastAPI could not parse was refused, naming ``body`` (never the parser's own words, which
    name interpreter settings)."""
    if isinstance(cause, UnicodeDecodeError):
        why = f"not UTF-8: byte 0x{cause.object[cause.start]:02X} at byte {cause.start} ({cause.reason})"
        return InvalidRequest(f"body is not valid JSON: {why}", "body", "JSON")
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):  # json's int parsing cap
        digits = sys.get_int_max_str_digits()
        return InvalidRequest(f"body holds an integer of more than {digits} digits; the limit is {digits} digits",
                              "body", digits)  # fmt: skip
    return InvalidRequest(f"body could not be parsed as JSON ({type(cause).__name__})", "body", "JSON")


def _on_redis_down(request: Request, exc: Exception) -> JSONResponse:
    log.warning("Redis unreachable: %s", exc)
    msg = f"the queue (Redis) is unreachable: {type(exc).__name__}; retry later"
    payload = error_payload("unavailable", type(exc).__name__, msg)
    if isinstance(exc, SubmitInterrupted):  # the IDs the gateway made: a retry under them is the same request
        payload["message"] = _interrupted_message(exc, openai=is_openai_path(request.url.path))
        payload.update(request_ids=exc.request_ids, queued_ids=exc.queued_ids, unknown_ids=exc.unknown_ids,
                       unqueued_ids=exc.unqueued_ids)  # fmt: skip
    return _respond(request, 503, payload, {"Retry-After": "5"})


def _interrupted_message(exc: SubmitInterrupted, *, openai: bool) -> str:
    """What a caller of an interrupted submit should do, without the Redis address or error text: send it again
    under the same ID (native routes take ``request_id``), or, on an OpenAI route, which takes none, poll it."""
    if not exc.unknown_ids:
        return "the queue (Redis) failed before anything was queued (unqueued_ids); retry later"
    ids = exc.unknown_ids
    which = f"request {ids[0]}" if len(ids) == 1 else f"{len(ids)} requests (unknown_ids)"
    if openai:
        return (f"the queue (Redis) failed while queueing: {which} may or may not be queued; once Redis is back, GET "
                f"/v1/requests/{ids[0]} says whether it runs before you send it again")
    return (f"the queue (Redis) failed while queueing: {which} may or may not be queued; once Redis is back, send "
            "the same body again under the same request_id (unknown_ids): a request ID is queued at most once, so "
            "it runs once")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.add_exception_handler(FleetError, _on_fleet_error)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(HTTPException, _on_http)
    app.add_exception_handler(redis.RedisError, _on_redis_down)
    app.add_exception_handler(OperationalError, _on_redis_down)
