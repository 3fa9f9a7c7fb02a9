"""The HTTP gateway's request and response bodies (JSON), as they appear in its OpenAPI document."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from producer.client import MAX_DEADLINE_S, RequestStatus
from protocol.keys import REQUEST_ID_PATTERN
from protocol.messages import GenerationParams, RequestFloat
from protocol.utf8 import Utf8Str

__all__ = [
    "REQUEST_ID_PATTERN",
    "BatchAccepted",
    "BatchSubmitBody",
    "ErrorBody",
    "OutputOptions",
    "RequestAccepted",
    "RequestView",
    "SubmitBody",
]



class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OutputOptions(_Body):
    """What the caller wants back (defaults follow the model's kind)."""

    kind: Literal["next_token", "generate", "embedding"] | None = Field(
        default=None,
        description="'next_token' or 'generate' (causal LM), 'embedding' (encoder); default by model "
        "('generate' when ``generation`` is given).",
    )
    top_k: StrictInt = Field(default=5, ge=1, description="Next-token candidates (<= the model's max_top_k); only for "
                             "'next_token' output: given with another kind, it is refused.")
    normalize: StrictBool = Field(default=True, description="L2-normalise embeddings.")
    generation: GenerationParams | None = Field(
        default=None,
        description="A generation's sampling and stop parameters (max_new_tokens <= the model's limit); "
        "stream its tokens from GET /v1/requests/{id}/stream.",
        examples=[{"max_new_tokens": 16}],
    )


class SubmitBody(_Body):
    """One request: exactly one of ``input_ids`` or ``text``."""

    model: Utf8Str = Field(min_length=1, max_length=200, examples=["demo-lm"])
    input_ids: list[StrictInt] | None = Field(
        default=None,
        description="Token ids, each in [0, vocab_size); at most the model's max_input_tokens.",
        examples=[[5, 6, 7]],
    )
    text: Utf8Str | None = Field(default=None, description="Text, tokenized by the gateway.")
    output: OutputOptions = Field(default_factory=OutputOptions)
    request_id: Utf8Str | None = Field(
        default=None,
        pattern=REQUEST_ID_PATTERN,
        description="Caller-given ID; resubmitting a known ID is a no-op (idempotent).",
    )
    deadline_s: RequestFloat | None = Field(
        default=None, gt=0, le=MAX_DEADLINE_S, description="Drop the request if it has not run within this many s."
    )
    routing_key: Utf8Str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="Sticky key for a model's canary split (e.g. a session ID): the same key always gets "
        "the same version while the split stands. Default: the request ID.",
    )


class BatchSubmitBody(_Body):
    """Many requests at once: all are queued, or none (the first problem is reported)."""

    requests: list[SubmitBody] = Field(min_length=1, description="At most api.max_batch_requests items.")


class RequestAccepted(BaseModel):
    """A queued request."""

    request_id: str
    status: RequestStatus = RequestStatus.QUEUED
    location: str = Field(description="Where to poll: /v1/requests/{request_id}.")
    warning: str | None = Field(default=None, description="Only when no live worker serves the model: the "
                                "request waits in its queue until one starts (a fleet scaled to zero).")


class BatchAccepted(BaseModel):
    """Every request of a batch, queued, in order."""

    requests: list[RequestAccepted]


class ErrorBody(BaseModel):
    """Every error response: a code, the error class, a message naming the field and the limit."""

    error: str = Field(examples=["input_too_long"])
    type: str = Field(examples=["InputTooLong"])
    message: str
    field: str | None = None
    limit: Any = None


class RequestView(BaseModel):
    """Where a request stands; ``result`` when it succeeded, ``error`` when it failed/expired/cancelled."""

    request_id: str
    status: RequestStatus
    result: dict[str, Any] | None = Field(default=None, description="The InferenceResult JSON.")
    error: ErrorBody | None = None
    warning: str | None = Field(default=None, description="While the request is queued and no live worker "
                                "serves its model: says so, and how to start one.")
