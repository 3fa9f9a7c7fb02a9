"""One served model's settings (``models.<name>``) and the sections under it but ``engine``: batching,
input limits, the canary guard and prefix-aware routing."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from protocol.settings_engine import EngineSettings
from protocol.settings_section import Section

__all__ = ["BatchingSettings", "CanarySettings", "LimitSettings", "ModelSettings", "RoutingSettings"]


class BatchingSettings(Section):
    """How the worker's scheduler forms micro-batches."""

    max_batch_size: int = Field(default=8, ge=1, le=1024, description="Sequences per batch.")
    max_wait_ms: float = Field(
        default=2.0,
        ge=0,
        le=10_000,
        description="Longest time the oldest pending sequence waits for company (ms). The window also "
        "closes early when every request the worker holds is already pending.",
    )
    max_batch_tokens: int = Field(
        default=16_384, ge=1, description="Cap on batch_size x padded length (tokens) of one batch."
    )
    close_when_idle: bool = Field(
        default=True,
        description="Close the window at once when no request the worker holds is still on its way.",
    )
    start_together_ms: float = Field(
        default=25.0,
        ge=0,
        le=10_000,
        description="Generations: while no sequence runs, the first to arrive waits up to this long for "
        "the requests the worker already holds (taken from Redis, still being decoded) and, when it holds "
        "none, for the messages still waiting on the lists it takes from, so a burst is prefilled together "
        "and decodes from one step; it starts as soon as they have all arrived or a full batch waits. A "
        "lone request never waits (ms; 0 = start at once).",
    )
    max_kv_tokens: int = Field(
        default=32_768,
        ge=1,
        description="Generation: KV-cache budget of the running set (tokens). A sequence joins only when "
        "its prompt + max_new_tokens fits beside the running ones' reservations.",
    )
    continuous: bool = Field(
        default=True,
        description="Generation: admit new sequences between decode steps (continuous batching). False = "
        "static batching: a batch runs until its last sequence finishes (kept for the bench).",
    )
    prefill_chunk_tokens: int = Field(
        default=512,
        ge=0,
        le=1_000_000,
        description="Generation: most prompt tokens prefilled in one step, over all joining sequences (chunked "
        "prefill): a longer prompt, or a burst of them, is prefilled over several steps while the running "
        "sequences keep decoding. 0 = every admitted prompt whole in one step.",
    )
    prefix_cache_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=0,
        le=1 << 40,
        description="Generation: bytes of finished sequences' KV cache the worker keeps (LRU) so that a "
        "prompt sharing their prefix (a conversation's next turn, a common system prompt) computes only "
        "its new tokens. 0 turns prefix reuse off.",
    )
    prefix_block_tokens: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Generation: prefixes are found (and routed on) in whole blocks of this many tokens; "
        "the shortest reusable prefix is one block.",
    )


class LimitSettings(Section):
    """Input limits enforced by producers and again by workers."""

    max_input_tokens: int = Field(default=256, ge=1, le=1_000_000, description="Tokens per request.")
    truncate: Literal["none", "left", "right"] = Field(
        default="none",
        description="'none' rejects over-long input; 'left' keeps the last tokens; 'right' the first.",
    )
    max_top_k: int = Field(default=64, ge=1, le=4096, description="Largest top_k a request may ask for.")
    max_new_tokens: int = Field(
        default=256, ge=1, le=1_000_000, description="Largest max_new_tokens a generation may ask for."
    )


class CanarySettings(Section):
    """When a canary version is rolled back without a human (:func:`protocol.model_state.guard_canary`).

    The canary is judged over the last ``window_s`` seconds of finished requests (only those since
    the last change of the model's state), and only once it has ``min_requests`` of them there.
    The "p99" bounds are judged at the highest percentile the window's requests support
    (:func:`protocol.canary_verdict.supported_percentile`): p99 from 100 requests, else p95 (20), p90
    (10), p75 (4), p50 (2); a nearest-rank p99 of fewer than 100 requests is their maximum, which one slow
    request would decide. The verdict's reason and figures name the percentile used.
    """

    window_s: float = Field(default=60.0, gt=0, le=86_400, description="Window of outcomes judged (s).")
    min_requests: int = Field(
        default=20, ge=1, le=1_000_000, description="Canary requests the window must hold before any verdict."
    )
    max_error_rate: float = Field(
        default=0.05, ge=0, le=1, description="Largest canary error rate (failed / finished) tolerated."
    )
    max_p99_ms: float | None = Field(
        default=None, gt=0, description="Largest canary p99 latency, enqueue to result (ms); None = off. With fewer "
        "than 100 canary requests in the window, their highest supported percentile (p95 from 20, p90 from 10, …) "
        "is compared instead, never their maximum.",
    )
    max_p99_ratio: float | None = Field(
        default=3.0,
        gt=0,
        description="Largest canary p99 / stable p99 (both over the window; checked when the stable version "
        "also has min_requests there); None = off. Both at the highest percentile both versions' requests "
        "support (p99 from 100 each, else p95 from 20, p90 from 10, …).",
    )
    check_interval_s: float = Field(
        default=2.0, gt=0, le=3600, description="How often each worker's reconciler runs the guard (s)."
    )


class RoutingSettings(Section):
    """Prefix-aware routing of generations to the worker that holds their prompt's prefix."""

    prefix_aware: bool = Field(
        default=True,
        description="Send a generation whose prompt starts with a prefix a live worker holds in its prefix "
        "cache (batching.prefix_cache_bytes) to that worker's own queue; the rest go to the model's queue. "
        "With one live worker no lookup is made: the model's queue reaches it too.",
    )
    max_direct_queued: int = Field(
        default=4,
        ge=1,
        le=100_000,
        description="A worker whose own queue already holds this many requests is passed over: the request "
        "goes to the model's queue, where any worker takes it.",
    )
    direct_wait_ms: float = Field(
        default=20.0,
        gt=0,
        le=250,
        description="While a worker waits for work, how often it also looks at its other queues (its own "
        "queue, the canary queue) (ms): a routed request waits at most this long on an idle worker.",
    )


class ModelSettings(Section):
    """One served model: its file, version, route and limits."""

    path: Path = Field(description="ONNX file; its model card is the .json next to it.")
    version: str | None = Field(
        default=None,
        description="Defaults to the card's version (a model without a card: config.json's _fleet_version or "
        "version, else 0.0.0).",
    )
    queue: str | None = Field(default=None, description="Celery queue; defaults to 'fleet.<name>'.")
    batching: BatchingSettings = Field(default_factory=BatchingSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    max_queue_depth: int = Field(default=10_000, ge=1, description="Admission cap on queued requests.")
    canary: CanarySettings = Field(default_factory=CanarySettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    store_version: str | None = Field(
        default=None,
        description="Serve this version from the model store (section 'store'): the worker fetches it into "
        "store.cache_dir, verifies every file's sha256 and only then loads it; 'path' may then be left out.",
    )

    @model_validator(mode="before")
    @classmethod
    def _path_from_store(cls, data: Any) -> Any:
        # a store-served model needs no local path: this one never exists, so producers and the gateway
        # read the card the worker publishes in Redis, as they do for any model not on their machine
        if isinstance(data, dict) and data.get("store_version") and data.get("path") is None:
            return {**data, "path": Path(f"store:{data['store_version']}")}
        return data
