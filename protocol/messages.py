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

from typing import Annotated, Any, Literal

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
)

from protocol.errors import DecodeError, InvalidRequest
from protocol.utf8 import Utf8Str

__all__ = [
    "BULK_TASK_NAME",
    "FLEET_TASK_PREFIX",
    "MAX_BULK_REQUESTS",
    "SCHEMA_VERSION",
    "TASK_NAME",
    "FinishReason",
    "Generation",
    "GenerationParams",
    "GenerationTimings",
    "InferenceRequest",
    "InferenceResult",
    "OutputSpec",
    "RequestFloat",
    "Timings",
    "TopToken",
    "Usage",
    "as_invalid_request",
    "decode_request",
    "decode_result",
    "limit_of",
]


RequestFloat = Annotated[float, Strict(), AllowInfNan(False)]
"""A number a request carries: a JSON number (not ``true``, not ``"0.5"``), finite (not ``NaN``/``Infinity``)."""

SCHEMA_VERSION = 1
TASK_NAME = "fleet.infer"
BULK_TASK_NAME = "fleet.infer_bulk"
FLEET_TASK_PREFIX = "fleet."
"""Only tasks named so run on the fleet's queues (a newer worker may know more of them than this one)."""
MAX_BULK_REQUESTS = 4096
"""Most requests one ``fleet.infer_bulk`` message may carry."""

OutputKind = Literal["next_token", "embedding", "generate"]
FinishReason = Literal["stop", "length", "cancelled", "deadline"]
"""Why a generation ended: EOS / a stop token / a stop string, ``max_new_tokens``, a cancel, its deadline."""
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GenerationParams(_Frozen):
    """How a ``generate`` job samples and when it stops (per request; all optional).

    Sampling is seeded per request (``numpy.random.Generator(seed)``, one draw per step), so the same
    request gives the same tokens alone, inside any batch and after a redelivery. ``temperature`` 0 is
    greedy (the seed is then irrelevant).
    """

    max_new_tokens: StrictInt = Field(
        default=16, ge=1, description="Most tokens to generate (<= limits.max_new_tokens)."
    )
    temperature: RequestFloat = Field(
        default=0.0, ge=0.0, le=100.0, description="0 = greedy; else softmax temperature."
    )
    top_k: StrictInt = Field(default=0, ge=0, description="Sample among the k most likely tokens; 0 = no cut.")
    top_p: RequestFloat = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 = no cut.")
    repetition_penalty: RequestFloat = Field(
        default=1.0, gt=0.0, le=10.0, description="CTRL-style penalty on tokens already in prompt or output; 1 = off."
    )
    stop_token_ids: list[StrictInt] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description="Tokens that end the generation."
    )
    stop: list[Utf8Str] = Field(
        default_factory=list,
        max_length=MAX_STOP_STRINGS,
        description="Strings that end the generation; the returned text stops before the first match.",
    )
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63, description="Sampling seed; None = 0.")
    ignore_eos: StrictBool = Field(default=False, description="Keep generating past the model's EOS token.")
    stream: StrictBool = Field(default=True, description="Publish each token to the request's Redis Stream.")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stops: list[str]) -> list[str]:
        for i, stop in enumerate(stops):
            if not 1 <= len(stop) <= 256:
                raise ValueError(f"stop[{i}] must be 1 to 256 characters long")
        return stops


class OutputSpec(_Frozen):
    """What the caller wants back."""

    kind: OutputKind | None = Field(
        default=None,
        description="'next_token' or 'generate' (causal LM), 'embedding' (encoder); default by model kind "
        "('generate' when ``generation`` is given).",
    )
    top_k: StrictInt = Field(default=5, ge=1, description="Next-token candidates returned (<= max_top_k).")
    normalize: StrictBool = Field(default=True, description="L2-normalise embeddings.")
    generation: GenerationParams | None = Field(default=None, description="Parameters of a 'generate' job.")


class InferenceRequest(_Frozen):
    """One tokenized request. ``request_id`` is informational: the Celery task id is authoritative."""

    schema_version: Literal[1] = 1
    model: str = Field(min_length=1, max_length=200)
    input_ids: list[StrictInt] = Field(description="Token ids; never empty, each in [0, vocab_size).")
    output: OutputSpec = Field(default_factory=OutputSpec)
    request_id: str | None = Field(default=None, max_length=200)
    truncated: StrictBool = Field(
        default=False, description="The producer already cut input_ids to the model's limits (reported in the result)."
    )
    submitted_at_unix_s: RequestFloat | None = Field(default=None, description="Producer wall clock (s).")
    deadline_unix_s: RequestFloat | None = Field(
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
    batch_started_unix_s: float | None = Field(
        default=None, description="When its batch (or a generation's prefill) was formed (wall clock, s)."
    )


class Usage(_Frozen):
    """Token counts of a generation (OpenAI's ``usage``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = Field(
        default=0, description="Of prompt_tokens: those whose KV came from the worker's prefix cache, not computed "
        "(OpenAI's prompt_tokens_details.cached_tokens).",
    )


class GenerationTimings(_Frozen):
    """Where a generation's time went."""

    time_to_first_token_ms: float = Field(description="Producer submit → first token produced (ms).")
    mean_inter_token_ms: float = Field(description="Mean time between consecutive tokens (ms); 0 for one token.")
    decode_steps: int = Field(description="Decode steps the sequence took part in.")
    batch_size_min: int = Field(description="Smallest running batch it was decoded in.")
    batch_size_mean: float = Field(description="Mean running batch size over its decode steps.")
    batch_size_max: int = Field(description="Largest running batch it was decoded in.")


class Generation(_Frozen):
    """What a ``generate`` job produced."""

    token_ids: list[int] = Field(
        description="Every generated id, the one that ended it (EOS or a stop token) included."
    )
    text: str | None = Field(
        description="Detokenized output, cut before a matched stop string; None without a tokenizer."
    )
    finish_reason: FinishReason
    usage: Usage
    timings: GenerationTimings


class InferenceResult(_Frozen):
    """The value stored under the request ID."""

    schema_version: Literal[1] = 1
    request_id: str
    model: str
    version: str = Field(description="The model version that computed this result.")
    role: Literal["stable", "canary"] | None = Field(
        default=None, description="The role of the engine that computed it (a canary-queue request runs on "
        "stable when the worker has no canary loaded)."
    )
    kind: OutputKind
    input_tokens: int = Field(description="Tokens actually computed (after truncation).")
    truncated: bool = False
    top_k: list[TopToken] | None = None
    embedding: list[float] | None = None
    generation: Generation | None = None
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


def as_invalid_request(exc: ValidationError, prefix: str = "") -> InvalidRequest:
    """A pydantic error in what a caller passed (a producer's arguments, a gateway body's values) as the
    fleet's :class:`InvalidRequest` naming the field; a message a worker cannot decode is a
    :class:`DecodeError` (:func:`decode_request`)."""
    field = _first_field(exc)
    field = f"{prefix}.{field}" if prefix and field != "request" else (prefix or field)
    errs = exc.errors()
    return InvalidRequest(_first_error(exc, prefix), field, limit_of(errs[0]) if errs else None)


LIMIT_KEYS = ("ge", "gt", "le", "lt", "max_length", "min_length", "multiple_of", "pattern")
"""Where pydantic's error context holds the bound a value broke."""


def limit_of(error: Any) -> Any:
    """The bound a pydantic error names (``le`` 256 of ``max_new_tokens``…), or None: the ``limit`` every fleet
    error carries beside its field."""
    ctx = error.get("ctx") if isinstance(error, dict) else None
    if not isinstance(ctx, dict):
        return None
    return next((ctx[key] for key in LIMIT_KEYS if key in ctx and isinstance(ctx[key], int | float | str)), None)


def _first_field(exc: ValidationError) -> str:
    errs = exc.errors()
    return ".".join(str(p) for p in errs[0]["loc"]) if errs and errs[0]["loc"] else "request"


def _first_error(exc: ValidationError, prefix: str = "") -> str:
    errs = exc.errors()
    if not errs:
        return "invalid request"
    err = errs[0]
    field = ".".join([prefix, *(str(p) for p in err["loc"])] if prefix else [str(p) for p in err["loc"]]) or "request"
    more = f" (and {len(errs) - 1} more errors)" if len(errs) > 1 else ""
    return f"invalid field {field}: {err['msg']}{more}"
