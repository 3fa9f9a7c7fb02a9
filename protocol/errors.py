"""The one error tree of onnx-fleet, shared by producers and workers.

::

    FleetError
    ├── ConfigError                 a setting broke a rule (named setting, rule)
    ├── ProviderUnavailable         require_provider is not active in the session
    ├── ModelLoadError              a model file or its card cannot be used
    ├── InvalidRequest              a request broke a limit (field, limit)
    │   ├── DecodeError             the message is not a valid request at all
    │   ├── EmptyInput              no tokens
    │   ├── InputTooLong            more than max_input_tokens
    │   ├── TokenOutOfRange         an id outside [0, vocab_size)
    │   ├── UnknownModel            no such model (or wrong queue for it)
    │   └── IncompatibleVersion     a version's card does not fit its model's (kind, vocab_size, …)
    ├── AdmissionRefused            refused before queueing
    │   ├── QueueFull               the model's queue is at its depth cap
    │   └── RateLimited             the caller's token bucket is empty
    ├── RequestExpired              its deadline passed before compute
    ├── RequestCancelled            it was cancelled before it ran
    ├── ResultTimeout               waiting for a result took longer than asked
    │   └── NoLiveWorker            ... and no live worker serves the request's model
    ├── RequestNotFound             no such request ID is known
    ├── IdempotencyConflict         a known request ID was resubmitted with a different body
    ├── SubmitInterrupted           Redis failed midway through a submit (IDs queued / unknown / not queued);
    │                               also a redis.ConnectionError, what such a failure raised before
    └── StateChangeRefused          a model-state change (pin, canary, promote, rollback) broke a rule

Every class can be rebuilt from its ``args`` (Celery stores a task's exception as its type
name plus ``args`` in JSON and rebuilds it on the client), so constructors take only
positional, JSON-friendly values: ``(message, field, limit)``.
"""

from __future__ import annotations

from typing import Any

import redis

__all__ = [
    "AdmissionRefused",
    "ConfigError",
    "DecodeError",
    "EmptyInput",
    "FleetError",
    "IdempotencyConflict",
    "IncompatibleVersion",
    "InputTooLong",
    "InvalidRequest",
    "ModelLoadError",
    "NoLiveWorker",
    "ProviderUnavailable",
    "QueueFull",
    "RateLimited",
    "RequestCancelled",
    "RequestExpired",
    "RequestNotFound",
    "ResultTimeout",
    "StateChangeRefused",
    "SubmitInterrupted",
    "TokenOutOfRange",
    "UnknownModel",
    "error_from_payload",
]


class FleetError(Exception):
    """Base of every onnx-fleet error; carries the offending field and the limit it broke."""

    code = "fleet_error"

    def __init__(self, message: str, field: str | None = None, limit: Any = None) -> None:
        super().__init__(message, field, limit)
        self.message = message
        self.field = field
        self.limit = limit

    def __str__(self) -> str:
        return self.message

    def to_payload(self) -> dict[str, Any]:
        """JSON-friendly form, as returned by the HTTP gateway and the CLI."""
        return {
            "error": self.code,
            "type": type(self).__name__,
            "message": self.message,
            "field": self.field,
            "limit": self.limit,
        }


class ConfigError(FleetError):
    """A setting broke a rule; raised at start-up so the process never runs half-configured."""

    code = "config_error"


class ProviderUnavailable(FleetError):
    """The required execution provider is not active in the ONNX Runtime session."""

    code = "provider_unavailable"


class ModelLoadError(FleetError):
    """A model file, its card or its tokenizer cannot be loaded or does not follow the I/O convention."""

    code = "model_load_error"


class InvalidRequest(FleetError):
    """A request broke a limit; it never reaches the engine."""

    code = "invalid_request"


class DecodeError(InvalidRequest):
    """The message is not a valid request (wrong type, missing or malformed field)."""

    code = "decode_error"


class EmptyInput(InvalidRequest):
    """The request carries no tokens."""

    code = "empty_input"


class InputTooLong(InvalidRequest):
    """The request carries more tokens than the model's max_input_tokens."""

    code = "input_too_long"


class TokenOutOfRange(InvalidRequest):
    """A token id lies outside the model's vocabulary [0, vocab_size)."""

    code = "token_out_of_range"


class UnknownModel(InvalidRequest):
    """No model of that name is configured (or the request reached another model's queue)."""

    code = "unknown_model"


class IncompatibleVersion(InvalidRequest):
    """A model version's card does not fit the model it is published, pinned or canaried under
    (:mod:`protocol.version_fit`): field = the first card field that differs, limit = the model's value."""

    code = "incompatible_version"


class AdmissionRefused(FleetError):
    """Admission control refused the request before it was queued."""

    code = "admission_refused"

    def __init__(
        self, message: str, field: str | None = None, limit: Any = None, retry_after_s: float = 1.0
    ) -> None:
        super().__init__(message, field, limit)
        self.args = (message, field, limit, retry_after_s)
        self.retry_after_s = retry_after_s
        self.queued_ids: list[str] = []
        """IDs of the requests a batch call (``submit_many``, ``submit_bulk``) queued, or found known, before
        this refusal stopped it, in input order; empty for a single request (nothing of it was queued)."""


class QueueFull(AdmissionRefused):
    """The model's queue holds max_queue_depth requests already."""

    code = "queue_full"


class RateLimited(AdmissionRefused):
    """The caller's rate-limit token bucket is empty."""

    code = "rate_limited"


class RequestExpired(FleetError):
    """The request's deadline passed while it was queued; it was never computed."""

    code = "expired"


class RequestCancelled(FleetError):
    """The request was cancelled before it ran."""

    code = "cancelled"

    @classmethod
    def before_run(cls, request_id: str) -> RequestCancelled:
        """The error of request ``request_id`` cancelled before it ran, as every face reports it (the worker
        that dropped it at take, in its batch window or before its prefill; a client or the gateway reading
        only its cancel mark)."""
        return cls(f"request {request_id} was cancelled before it ran", "request_id", None)


class ResultTimeout(FleetError):
    """No result arrived within the time the caller was willing to wait."""

    code = "result_timeout"


class NoLiveWorker(ResultTimeout):
    """A wait ended while no live worker serves the request's model; the request stays queued for one."""

    code = "no_worker"


class RequestNotFound(FleetError):
    """No request with that ID is known (never submitted, or its result expired)."""

    code = "not_found"


class IdempotencyConflict(FleetError):
    """A request ID already known was submitted again with a different body (HTTP 409); nothing was queued."""

    code = "idempotency_conflict"

    def __init__(self, message: str, field: str | None = None, limit: Any = None) -> None:
        super().__init__(message, field, limit)
        self.queued_ids: list[str] = []
        """As :attr:`AdmissionRefused.queued_ids`: what a batch call queued, or found known, before this
        conflict stopped it (in input order)."""


class SubmitInterrupted(redis.ConnectionError, FleetError):
    """Redis failed (connection lost, timeout, restart) while a submit was queueing; the Redis error is its
    ``__cause__``. A ``redis.ConnectionError`` first (code that caught Redis errors still does; the gateway
    answers it 503 as before), a FleetError too. Each ID of the call is in exactly one of ``queued_ids``
    (queued, or known already: it runs or ran once), ``unknown_ids`` (its Redis step was in flight: queued
    or not, nobody can tell) and ``unqueued_ids`` (never sent); all in input order, a repeated ID once.
    ``request_ids`` holds every input's ID in input order: submitting the same inputs again under them is
    safe, since a request ID is queued at most once (the known ones are not queued again)."""

    code = "submit_interrupted"

    def __init__(
        self,
        message: str,
        field: str | None = None,
        limit: Any = None,
        queued_ids: list[str] | tuple[str, ...] = (),
        unknown_ids: list[str] | tuple[str, ...] = (),
        unqueued_ids: list[str] | tuple[str, ...] = (),
        request_ids: list[str] | tuple[str, ...] = (),
    ) -> None:
        super().__init__(message, field, limit)
        self.queued_ids = list(queued_ids)
        self.unknown_ids = list(unknown_ids)
        self.unqueued_ids = list(unqueued_ids)
        self.request_ids = list(request_ids)
        self.args = (message, field, limit, self.queued_ids, self.unknown_ids, self.unqueued_ids, self.request_ids)

    def to_payload(self) -> dict[str, Any]:
        """:meth:`FleetError.to_payload` plus the four ID lists."""
        return {**super().to_payload(), "queued_ids": self.queued_ids, "unknown_ids": self.unknown_ids,
                "unqueued_ids": self.unqueued_ids, "request_ids": self.request_ids}  # fmt: skip


class StateChangeRefused(FleetError):
    """A change of a model's desired state was refused (no canary to promote, a weight out of range)."""

    code = "state_change_refused"


_BY_NAME: dict[str, type[FleetError]] = {
    cls.__name__: cls
    for cls in (
        ConfigError,
        ProviderUnavailable,
        ModelLoadError,
        InvalidRequest,
        DecodeError,
        EmptyInput,
        InputTooLong,
        TokenOutOfRange,
        UnknownModel,
        IncompatibleVersion,
        AdmissionRefused,
        QueueFull,
        RateLimited,
        RequestExpired,
        RequestCancelled,
        ResultTimeout,
        NoLiveWorker,
        RequestNotFound,
        IdempotencyConflict,
        SubmitInterrupted,
        StateChangeRefused,
        FleetError,
    )
}


def error_from_payload(type_name: str, args: Any) -> FleetError:
    """Rebuild a FleetError from a stored type name and its args (unknown types become FleetError)."""
    cls = _BY_NAME.get(type_name, FleetError)
    values = list(args) if isinstance(args, list | tuple) else [str(args)]
    message = str(values[0]) if values else type_name
    field = values[1] if len(values) > 1 and isinstance(values[1], str) else None
    limit = values[2] if len(values) > 2 else None
    return cls(message, field, limit)
