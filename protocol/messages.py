"""The wire contract: frozen pydantic models for requests and results, JSON only.

A request travels as the single positional argument of the Celery task ``fleet.infer``
(a JSON object); its result is the task's return value (a JSON object). Any Celery client
can speak it::

    app.send_task("fleet.infer", args=[{"model": "demo-lm", "input_ids": [5, 6, 7]}],
                  queue="fleet.demo-lm", task_id="my-id")

Wall-clock times (``*_unix_s``) appear only in messages, where they cross machines; windows and
deadlines inside a process use ``time.monotonic()``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from protocol.errors import DecodeError

__all__ = [
    "BULK_TASK_NAME",
    "MAX_BULK_REQUESTS",
    "SCHEMA_VERSION",
    "TASK_NAME",
    "InferenceRequest",
    "InferenceResult",
    "OutputSpec",
    "Timings",
    "TopToken",
    "decode_request",
    "decode_result",
]

SCHEMA_VERSION = 1
TASK_NAME = "fleet.infer"
BULK_TASK_NAME = "fleet.infer_bulk"
MAX_BULK_REQUESTS = 4096
"""Most requests one ``fleet.infer_bulk`` message may carry."""

OutputKind = Literal["next_token", "embedding"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OutputSpec(_Frozen):
    """What the caller wants back."""

    kind: OutputKind | None = Field(
        default=None, description="'next_token' (causal LM) or 'embedding' (encoder); default by model kind."
    )
    top_k: StrictInt = Field(default=5, ge=1, description="Next-token candidates returned (<= max_top_k).")
    normalize: StrictBool = Field(default=True, description="L2-normalise embeddings.")


class InferenceRequest(_Frozen):
    """One tokenized request. ``request_id`` is informational: the Celery task id is authoritative."""

    schema_version: Literal[1] = 1
    model: str = Field(min_length=1, max_length=200)
    input_ids: list[StrictInt] = Field(description="Token ids; never empty, each in [0, vocab_size).")
    output: OutputSpec = Field(default_factory=OutputSpec)
    request_id: str | None = Field(default=None, max_length=200)
    submitted_at_unix_s: float | None = Field(default=None, description="Producer wall clock (s).")
    deadline_unix_s: float | None = Field(
        default=None, description="Wall-clock time after which the request is dropped as expired (s)."
    )


class TopToken(_Frozen):
    """One next-token candidate."""

    token_id: int
    logprob: float = Field(description="Natural-log probability at the last real position.")


class Timings(_Frozen):
    """Where the request's time went."""

    queue_wait_ms: float = Field(description="Producer submit → batch start (ms; wall clocks of two hosts).")
    batch_wait_ms: float = Field(description="Arrival at the scheduler → batch start (ms).")
    inference_ms: float = Field(description="Engine time of the batch it ran in (ms).")
    batch_size: int = Field(description="Sequences in the batch it ran in.")
    padded_tokens: int = Field(description="batch_size x padded length of that batch.")
    worker: str = Field(description="Celery hostname of the worker that computed it.")


class InferenceResult(_Frozen):
    """The value stored under the request ID."""

    schema_version: Literal[1] = 1
    request_id: str
    model: str
    version: str
    kind: OutputKind
    input_tokens: int = Field(description="Tokens actually computed (after truncation).")
    truncated: bool = False
    top_k: list[TopToken] | None = None
    embedding: list[float] | None = None
    timings: Timings


def decode_request(payload: Any) -> InferenceRequest:
    """Parse a task argument into a request.

    Raises:
        DecodeError: the payload is not a JSON object of the request schema; names the first bad field.
    """
    if not isinstance(payload, dict):
        raise DecodeError(
            f"request must be a JSON object, got {type(payload).__name__}", "request", "JSON object"
        )
    try:
        return InferenceRequest.model_validate(payload)
    except ValidationError as exc:
        raise DecodeError(_first_error(exc), _first_field(exc), None) from exc


def decode_result(payload: Any) -> InferenceResult:
    """Parse a stored task result.

    Raises:
        DecodeError: the payload does not follow the result schema.
    """
    try:
        return InferenceResult.model_validate(payload)
    except ValidationError as exc:
        raise DecodeError(_first_error(exc), _first_field(exc), None) from exc


def _first_field(exc: ValidationError) -> str:
    errs = exc.errors()
    return ".".join(str(p) for p in errs[0]["loc"]) if errs and errs[0]["loc"] else "request"


def _first_error(exc: ValidationError) -> str:
    errs = exc.errors()
    if not errs:
        return "invalid request"
    err = errs[0]
    field = ".".join(str(p) for p in err["loc"]) or "request"
    more = f" (and {len(errs) - 1} more errors)" if len(errs) > 1 else ""
    return f"invalid field {field}: {err['msg']}{more}"
