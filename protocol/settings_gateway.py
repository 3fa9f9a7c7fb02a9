"""The HTTP faces' sections: the gateway (``api``), its per-key rate limit (``admission``) and Flower."""

from __future__ import annotations

from pydantic import Field, field_validator

from protocol.settings_section import Section

__all__ = ["AdmissionSettings", "ApiSettings", "FlowerSettings"]


class ApiSettings(Section):
    """HTTP gateway."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    api_keys: list[str] = Field(
        default_factory=list, description="Accepted X-API-Key values; [] = no auth. Each is printable ASCII "
        "(no control characters, no space at either end): what an HTTP header carries unchanged.",
    )
    max_body_bytes: int = Field(default=1_048_576, ge=1024, description="Largest request body (bytes).")
    max_batch_requests: int = Field(
        default=256, ge=1, le=100_000, description="Requests one POST /v1/requests:batch may carry."
    )
    no_worker_wait_s: float = Field(
        default=30.0, ge=0, le=600, description="An OpenAI-route call for a model no live worker serves waits "
        "this long for one to appear (scale from zero), then answers 503 no_worker and cancels the request: no worker "
        "runs it later, for a caller that has gone (s).",
    )
    responses_ttl_s: int = Field(
        default=30 * 24 * 3600, ge=60, le=365 * 24 * 3600, description="How long a stored /v1/responses response "
        "(and so its conversation) lives in Redis for retrieval and previous_response_id (s); OpenAI keeps 30 days.",
    )
    max_wait_s: float = Field(
        default=60.0, ge=0, le=600, description="Longest long-poll of GET /v1/requests/{id}?wait_s=...: the "
        "call answers as soon as the result is stored, else at wait_s with the current status (s).",
    )
    group_submits: bool = Field(
        default=True, description="Queue the submissions that arrive while the previous Redis step is in flight "
        "(POST /v1/requests without request_id, /v1/embeddings, /v1/completions, /v1/chat/completions) together, "
        "in one Redis step: one fleet.infer_bulk message per group and queue for one-step requests, one "
        "fleet.infer task each for generations (a lone request is still one fleet.infer task). false: each "
        "submission its own Redis step.",
    )
    max_grouped_requests: int = Field(
        default=256, ge=1, le=4096, description="Most requests one grouped submission queues (the rest waits "
        "for the next group; one caller's requests are never split).",
    )
    max_head_bytes: int = Field(
        default=65_536, ge=4096, le=1 << 20, description="Most bytes of one request line and its headers; more is "
        "answered 431 naming headers, before the API key is looked at (bytes).",
    )
    max_headers: int = Field(
        default=100, ge=16, le=10_000, description="Most header lines of one request; more is answered 431."
    )
    head_timeout_s: float = Field(
        default=10.0, ge=1, le=600, description="Time a connection has to send a whole request head once the "
        "gateway waits for one; then it is closed (408 when part of a head came). Requests being answered (long "
        "polls, streams) are not timed (s).",
    )
    body_timeout_s: float = Field(
        default=60.0, ge=1, le=3600, description="Time a request body has to arrive whole once the gateway reads it "
        "(after the head and the key check; Content-Length and chunked bodies alike): then it is answered 408 naming "
        "body and the connection closed, so a body that stops short, or trickles, holds no slot of "
        "max_concurrent_requests. 1 MiB (max_body_bytes' default) in 60 s is 17 KiB/s (s).",
    )
    max_concurrent_requests: int = Field(
        default=0, ge=0, le=1_000_000, description="Most requests this gateway process answers at once (long polls "
        "and streams included); one more is answered 503 with Retry-After: 1 (the probes and /metrics never are). "
        "0 = three quarters of the process's open-file limit.",
    )
    write_stall_s: float = Field(
        default=60.0, ge=1, le=3600, description="Time a response may wait for its client to read (a stream "
        "reader that stopped reading): then the connection is aborted, and a stream's request cancelled as on any "
        "disconnect (s).",
    )

    @field_validator("api_keys")
    @classmethod
    def _header_safe_keys(cls, keys: list[str]) -> list[str]:
        """A key arrives in a header, which carries ASCII (read as latin-1, and stripped at both ends): a key
        with another character, or a space at an end, could never match what a client sends. Never shows a key."""
        for i, key in enumerate(keys):
            if not key:
                raise ValueError(f"key {i} is empty")
            bad = next((n for n, c in enumerate(key) if not " " <= c <= "~"), None)
            if bad is not None:
                what = "a control character" if ord(key[bad]) < 0x20 or key[bad] == "\x7f" else "a non-ASCII character"
                raise ValueError(f"key {i} holds {what} at character {bad}: an API key must be printable ASCII "
                                 "(a header carries nothing else unchanged)")  # fmt: skip
            if key != key.strip():
                raise ValueError(f"key {i} starts or ends with a space (headers are stripped at both ends)")
        return keys


class AdmissionSettings(Section):
    """Per-API-key rate limit (token bucket kept in Redis)."""

    rate_capacity: float = Field(default=0, ge=0, description="Bucket size (requests); 0 = no rate limit.")
    rate_refill_per_s: float = Field(default=0, ge=0, description="Refill rate (requests/s).")
    drain_window_s: float = Field(
        default=30, gt=0, le=3600, description="Window over which a queue's drain rate is measured (s)."
    )
    max_retry_after_s: int = Field(
        default=60, ge=1, le=86_400, description="Cap on the Retry-After a refusal advises (s)."
    )
    queue_depth_cache_ms: float = Field(
        default=250,
        ge=0,
        le=5_000,
        description="How long a producer reuses one queue-depth read, adding what it admitted since (ms); "
        "0 = read on every submission. Other producers' submissions inside it are not seen.",
    )


class FlowerSettings(Section):
    """Flower, the Celery monitor started by ``fleet flower``; it always runs with basic auth."""

    host: str = "127.0.0.1"
    port: int = Field(default=5555, ge=1, le=65535)
    basic_auth: list[str] = Field(
        default_factory=list,
        description="'user:password' entries (no commas); `fleet flower` refuses to start without one.",
    )

    @field_validator("basic_auth")
    @classmethod
    def _user_password_pairs(cls, entries: list[str]) -> list[str]:
        for i, entry in enumerate(entries):
            user, sep, password = entry.partition(":")
            if not sep or not user or not password or "," in entry:
                raise ValueError(f"entry {i} must be 'user:password' with both parts non-empty and no comma")
        return entries
