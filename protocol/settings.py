"""Settings: one validated object per process, built once in ``main()`` and passed down.

Sources, highest priority first:

0. the keyword overrides of :func:`load_settings` (``FleetClient.from_settings(**overrides)``, CLI flags);
1. environment variables ``FLEET_*`` with ``__`` for nesting, e.g.
   ``FLEET_REDIS_URL=redis://host:6379/0``, ``FLEET_WORKER__CONCURRENCY=16``,
   ``FLEET_MODELS__DEMO_LM__BATCHING__MAX_WAIT_MS=5`` (model names match case-insensitively,
   with ``-`` and ``_`` treated alike);
2. the YAML file named by ``FLEET_CONFIG`` (default ``configs/fleet.yaml``);
3. the defaults below.

An invalid value raises :class:`protocol.errors.ConfigError` naming the setting and the rule.
"""

from __future__ import annotations

import contextvars
import difflib
import logging
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from protocol.errors import ConfigError, UnknownModel

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DIRECT_QUEUE_INFIX",
    "AdmissionSettings",
    "ApiSettings",
    "BatchingSettings",
    "CanarySettings",
    "CelerySettings",
    "EngineSettings",
    "FleetSettings",
    "FlowerSettings",
    "LimitSettings",
    "LogSettings",
    "ModelSettings",
    "RedisSettings",
    "RoutingSettings",
    "StoreSettings",
    "WorkerSettings",
    "deep_merge",
    "load_settings",
    "shared_queue_of",
]

DEFAULT_CONFIG_PATH = Path("configs/fleet.yaml")
PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
GRAPH_CAPTURE_OPTIONS = {"CUDAExecutionProvider": "enable_cuda_graph",
                         "TensorrtExecutionProvider": "trt_cuda_graph_enable"}
"""Each GPU provider's own option to capture runs as CUDA graphs: refused in ``provider_options`` (the fleet's
runs change shape); ``engine.cuda_graph`` sets the CUDA one where the shapes are fixed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchingSettings(_Section):
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


class LimitSettings(_Section):
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


class EngineSettings(_Section):
    """ONNX Runtime session options and the execution-provider chain."""

    providers: list[str] = Field(default_factory=lambda: list(PROVIDERS))
    provider_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    require_provider: str | None = Field(
        default=None, description="Fail start-up unless this provider is active in the session."
    )
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    intra_op_threads: int = Field(default=0, ge=0, le=256, description="0 lets ORT choose.")
    inter_op_threads: int = Field(default=1, ge=0, le=256)
    allow_spinning: bool | Literal["bounded"] = Field(
        default="bounded",
        description="ORT intra-op spin-waiting on CPU. 'bounded' (default): spin at most spin_duration_us after "
        "each run, so back-to-back generation steps find the threads awake while an idle worker stops spinning "
        "within that bound; true: ORT's own spin (keeps a core busy after every run, time Celery and Redis "
        "need); false: threads sleep as soon as a run ends. Figures: docs/spinning.md.",
    )
    spin_duration_us: int = Field(
        default=2000, ge=1, le=1_000_000,
        description="With allow_spinning 'bounded': how long ORT's threads spin after a run before they sleep "
        "(microseconds).",
    )
    trt_fp16: bool = True
    trt_int8: bool = False
    cache_dir: Path = Field(default=Path("var/trt-cache"), description="TensorRT engine + timing caches.")
    warmup: bool = Field(default=True, description="Run the extreme shapes once before consuming.")
    report_placement: bool = Field(
        default=True,
        description="At load, count the nodes each execution provider runs in the served graph (one "
        "profiled 1x1 run, profiling then off) for the heartbeat, `fleet status` and fleet_engine_nodes.",
    )
    lm_head_last: bool = Field(
        default=True,
        description="Causal LMs: rewrite the graph in memory at load so logits are computed at the last "
        "position only (tools/lm_head_last.py); skipped for files with external data.",
    )
    kv_cache: Literal["auto", "in_place", "concat"] = Field(
        default="auto",
        description="Causal LMs: 'in_place' rewrites each layer's attention at load into ONNX Runtime's "
        "GroupQueryAttention so the KV cache is a preallocated buffer written at each sequence's own "
        "position (tools/inplace_kv.py; a join or leave moves no other sequence's cache, a decode step copies "
        "no past), checked against the original graph on a probe; 'concat' serves the graph's own "
        "Concat cache; 'auto' = in_place where it applies (the CPU provider, or a GPU chain with the CUDA "
        "provider and a float16 graph; a graph the rewrite matches; the probe equal), concat otherwise, with "
        "the reason logged.",
    )

    cuda_graph: bool = Field(
        default=False,
        description="Causal LMs on the CUDA provider: capture each decode step as a CUDA graph and replay it "
        "(ONNX Runtime's enable_cuda_graph), one graph per span of KV slots, so a step costs one graph launch "
        "instead of a kernel launch per node. Needs the in-place KV cache (fixed-shape steps at fixed "
        "addresses) and a chain whose GPU provider is CUDA alone; otherwise, or when ONNX Runtime refuses the "
        "capture at load, the steps run without graphs and the reason is logged. Figures: docs/gpu.md.",
    )

    @model_validator(mode="after")
    def _known_providers(self) -> EngineSettings:
        for name in [*self.providers, *([self.require_provider] if self.require_provider else [])]:
            if name not in PROVIDERS:
                raise ValueError(f"unknown execution provider {name!r}; known: {', '.join(PROVIDERS)}")
        if not self.providers:
            raise ValueError("providers must name at least one execution provider")
        return self

    @model_validator(mode="after")
    def _graphs_through_cuda_graph(self) -> EngineSettings:
        for provider, option in GRAPH_CAPTURE_OPTIONS.items():
            if str(self.provider_options.get(provider, {}).get(option, "0")).lower() not in ("0", "false"):
                raise ValueError(
                    f"provider_options.{provider}.{option}: ONNX Runtime would capture the first run's shapes "
                    "and replay them for every later run, whatever its batch; set engine.cuda_graph: true "
                    "instead (the decode steps of the in-place KV cache, one graph per span of slots)")
        return self


class CanarySettings(_Section):
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


class RoutingSettings(_Section):
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


class ModelSettings(_Section):
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


class StoreSettings(_Section):
    """The model store (``store/``): where versions are published and workers fetch them from.

    Names only. S3 credentials come from the environment or boto3's chain (``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, an instance role), never from this file.
    """

    backend: Literal["none", "s3", "local"] = Field(default="none", description="'none' = no store.")
    endpoint_url: str | None = Field(
        default=None, pattern=r"^https?://", description="S3 endpoint; None = AWS (or $AWS_ENDPOINT_URL_S3)."
    )
    bucket: str | None = Field(default=None, min_length=3, max_length=63, description="S3 bucket (backend s3).")
    region: str | None = Field(default=None, description="S3 region; None = boto3's default.")
    root: Path | None = Field(default=None, description="Directory of the store (backend local).")
    cache_dir: Path = Field(
        default=Path("var/model-cache"),
        description="Where workers keep verified versions: <cache_dir>/<model>/<version>/.",
    )
    reverify_cached: bool = Field(
        default=False,
        description="Re-hash a cached version's files at every start (default: sizes + the verification marker).",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_secrets(cls, data: Any) -> Any:
        secret_words = ("secret", "access_key", "password", "token", "credential")
        for key in data if isinstance(data, dict) else ():
            if any(word in str(key).lower() for word in secret_words):
                raise ValueError(
                    f"store.{key}: credentials are never read from the settings; set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment"
                )
        return data

    @model_validator(mode="after")
    def _backend_needs(self) -> StoreSettings:
        if self.backend == "s3" and not self.bucket:
            raise ValueError("store.backend is 's3': set store.bucket")
        if self.backend == "local" and self.root is None:
            raise ValueError("store.backend is 'local': set store.root (a directory)")
        return self


class WorkerSettings(_Section):
    """What one worker process serves and how many requests it holds at once."""

    model: str = Field(default="demo-lm", description="The one model this process serves.")
    concurrency: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Token-bucket size C: requests held from dequeue to result write (threads).",
    )
    heartbeat_s: float = Field(default=2.0, gt=0, le=60, description="Registry heartbeat period (s).")
    loglevel: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus port; 0 = off.")
    max_deliveries: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Times one message may be delivered; a message back after that many deliveries without "
        "an ack (its worker died each time: segfault, OOM, os._exit) is dead-lettered, not run again (not a copy "
        "of a generation a live worker still runs: it waits for that outcome).",
    )
    reconcile_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="How often a worker re-reads its model's desired state (pinned / canary version) besides "
        "the pub/sub notice: pub/sub is instant but lossy across reconnects; the periodic read converges.",
    )
    allow_untested_kombu: bool = Field(
        default=False,
        description="Start even when celery or kombu is outside the versions the fleet was tested with "
        "(broker.TESTED; broker/ adapts their internals); logged as a warning at every start.",
    )
    metrics_host: str | None = Field(
        default=None,
        description="Address the metrics port binds; None = where the gateway binds (api.host, 127.0.0.1 by "
        "default). Set 0.0.0.0 where a scraper on another host must reach it (docker-compose does).",
    )
    stall_after_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="A worker that holds requests (or whose queue is non-empty) and completes, takes or "
        "computes nothing for this long reports not ready (heartbeat, fleet probe ready): it holds work it "
        "is not progressing (s).",
    )
    slot_grace_s: float = Field(
        default=30.0,
        ge=0,
        le=86_400,
        description="A request held past its deadline (no deadline: past visibility_timeout_s) by more than "
        "this is reported as an overdue slot: a log line and fleet_worker_overdue_slots (s).",
    )
    stream_hold_events: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="Most token-stream events a worker holds while Redis does not answer (written, in order, "
        "when it does); past it tokens are dropped (fleet_worker_stream_events_dropped_total) and readers "
        "finish those streams from the stored results.",
    )
    stream_window_ms: float = Field(
        default=25.0,
        ge=0,
        le=1000,
        description="Token streams: the publisher waits this long after the first pending event before it "
        "writes, so each stream's tokens of several decode steps go out as one entry (fewer XADDs, less "
        "worker CPU; a token reaches readers up to this much later, a stream's first token never waits). "
        "0 = write at once (events that piled up during a write are coalesced anyway). docs/streaming.md.",
    )
    stream_hold_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        le=4 * 1024**3,
        description="Most bytes of token-stream events a worker holds while Redis does not answer (see "
        "stream_hold_events).",
    )


class ApiSettings(_Section):
    """HTTP gateway."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    api_keys: list[str] = Field(default_factory=list, description="Accepted X-API-Key values; [] = no auth.")
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


class LogSettings(_Section):
    """Log lines of the gateway and the workers (``fleet api``, ``celery -A workers.app worker``)."""

    format: Literal["text", "json"] = Field(
        default="text",
        description="'json': one JSON object per line (ts, level, logger, message), with request_id on the "
        "gateway's access lines and on worker lines that concern a request (FLEET_LOG__FORMAT=json).",
    )


class AdmissionSettings(_Section):
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


class FlowerSettings(_Section):
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


class RedisSettings(_Section):
    """How to reach Redis beyond ``redis_url``: TLS files and the Sentinel master (see
    :mod:`protocol.redis_conn`). Paths and names only: a password travels in ``FLEET_REDIS_URL``."""

    tls_ca_file: Path | None = Field(
        default=None, description="rediss://: CA bundle (PEM) the server's certificate is checked against."
    )
    tls_cert_file: Path | None = Field(default=None, description="rediss://: client certificate (PEM), if asked.")
    tls_key_file: Path | None = Field(default=None, description="rediss://: the client certificate's key (PEM).")
    sentinel_master: str | None = Field(
        default=None, description="sentinel://: the master name the sentinels monitor (required with one)."
    )


# -- Celery's per-task extras (dispatch cost; priced per request in docs/benchmarks.md) ------------
class CelerySettings(_Section):
    """Celery's per-task extras: each costs Redis commands and CPU on every request (see the
    Dispatch cost section of ``docs/benchmarks.md``). The defaults keep Flower's live view."""

    task_events: bool = Field(
        default=True,
        description="The worker's task events (received, started, succeeded): what Flower shows. Gathered for "
        "`task_event_linger_ms` and published as one message; `fleet worker` also passes -E, which turns "
        "them on regardless.",
    )
    task_event_linger_ms: float = Field(
        default=20.0,
        ge=0,
        le=1000,
        description="How long (ms) a worker gathers its task events before publishing them as one task.multi "
        "message from a thread of its own, off the requests' path; Flower sees each event up to this much later, "
        "with the time it happened. 0 = one PUBLISH per event on the request's own thread (Celery's behaviour "
        "on the threads pool).",
    )
    sent_events: bool = Field(
        default=True,
        description="The producer's task-sent event (one PUBLISH per request): Flower lists a request while it "
        "waits in the queue and shows its queue (routing_key); without it, only from when a worker receives it.",
    )
    track_started: bool = Field(
        default=False,
        description="Store a STARTED state when any task starts (GET, SETEX + PUBLISH): RequestStatus RUNNING. "
        "Off, a worker stores it for generation requests only (they run long enough to be seen running, and "
        "cancel reads it); a one-step request goes from queued to its result.",
    )
    result_extended: bool = Field(
        default=False,
        description="Store the task's name, args, worker and queue beside its result (Celery's result_extended): "
        "nothing in the fleet reads them, and the args repeat the input ids in every stored result.",
    )


class FleetSettings(BaseSettings):
    """Everything one process needs; see the module docstring for sources and priorities."""

    model_config = SettingsConfigDict(
        env_prefix="FLEET_",
        env_nested_delimiter="__",
        case_sensitive=False,
        extra="forbid",
        frozen=True,
        hide_input_in_errors=True,  # a rejected redis_url may hold a password: never echo it back
    )

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        pattern=r"^(redis|rediss|unix|sentinel)://",
        description="redis://, rediss:// (TLS), unix:// or sentinel://host:port;sentinel://… (protocol.redis_conn).",
    )
    redis: RedisSettings = Field(default_factory=RedisSettings)
    result_ttl_s: int = Field(default=3600, ge=1, le=30 * 86400, description="How long results live (s).")
    visibility_timeout_s: int = Field(
        default=3600,
        ge=1,
        description="Redis broker: an unacked request is redelivered after this long (s). Must exceed the "
        "longest one-step batch wait + inference; a generation's worker renews it at each heartbeat while it runs.",
    )
    models: dict[str, ModelSettings] = Field(default_factory=dict)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    flower: FlowerSettings = Field(default_factory=FlowerSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    celery: CelerySettings = Field(default_factory=CelerySettings)
    log: LogSettings = Field(default_factory=LogSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML file arrives as init kwargs; environment variables must beat it. load_settings' overrides
        # are applied to settings already built from both: then the init kwargs are the only source.
        if _OVERRIDING.get():
            return (init_settings,)
        return (env_settings, init_settings)

    @model_validator(mode="before")
    @classmethod
    def _merge_env_model_names(cls, data: Any) -> Any:
        """Let ``FLEET_MODELS__DEMO_LM__…`` address the YAML model ``demo-lm``.

        pydantic-settings lower-cases env keys, so that variable arrives as a second model
        ``demo_lm``. Keys that differ only by case or ``-``/``_`` are merged under the YAML
        spelling, the env-shaped one (lower case, no ``-``) winning field by field.
        """
        if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
            return data
        merged: dict[str, Any] = {}
        names: dict[str, str] = {}
        env_shaped = sorted(data["models"], key=lambda k: k == k.lower() and "-" not in k)
        for key in env_shaped:
            value = data["models"][key]
            norm = _norm(key)
            if norm in names and isinstance(value, dict) and isinstance(merged[names[norm]], dict):
                merged[names[norm]] = deep_merge(merged[names[norm]], value)
            else:
                names[norm] = key
                merged[key] = value
        return {**data, "models": merged}

    @field_validator("redis_url")
    @classmethod
    def _check_redis_ports(cls, url: str) -> str:
        """Each host's port (every ``;``-separated part of a sentinel:// list) is a number from 0 to 65535:
        refused here, not by the first connection (the message never shows the URL: it may hold a password)."""
        try:
            _ = [urlsplit(part.strip()).port for part in url.split(";")]  # .port raises on a bad one
        except ValueError:  # not echoed: in redis://USER:PASSWORD/0 (no @HOST), urlsplit's "port" is the password
            raise ValueError("a port must be a number from 0 to 65535 (redis://HOST:PORT/DB)") from None
        return url

    @model_validator(mode="after")
    def _check_redis(self) -> FleetSettings:
        scheme = self.redis_url.partition("://")[0].lower()
        tls_files = [n for n in ("tls_ca_file", "tls_cert_file", "tls_key_file") if getattr(self.redis, n)]
        if tls_files and scheme != "rediss":
            raise ValueError(f"redis.{tls_files[0]} is set but redis_url is not rediss:// (TLS files need one)")
        if scheme == "sentinel" and not self.redis.sentinel_master:
            raise ValueError("redis_url is sentinel://: set redis.sentinel_master to the name the sentinels monitor")
        return self

    @model_validator(mode="after")
    def _check_store(self) -> FleetSettings:
        served = [name for name, model in self.models.items() if model.store_version]
        if served and self.store.backend == "none":
            raise ValueError(f"models.{served[0]}.store_version is set but store.backend is 'none': configure 'store'")
        return self

    @model_validator(mode="after")
    def _check_models(self) -> FleetSettings:
        for name, model in self.models.items():
            if self.worker.model == name and self.worker.concurrency < model.batching.max_batch_size:
                raise ValueError(
                    f"worker.concurrency ({self.worker.concurrency}) must be >= "
                    f"models.{name}.batching.max_batch_size ({model.batching.max_batch_size}): "
                    "a batch can never exceed the tokens a worker holds"
                )
        return self

    def model_key(self, name: str) -> str:
        """The configured key for ``name`` (case and ``-``/``_`` insensitive).

        Raises:
            UnknownModel: no such model is configured.
        """
        wanted = _norm(name)
        for key in self.models:
            if _norm(key) == wanted:
                return key
        known = ", ".join(sorted(self.models)) or "none"
        raise UnknownModel(f"unknown model {name!r}; configured models: {known}", "model", known)

    def model(self, name: str) -> ModelSettings:
        """Settings of model ``name``; raises :class:`UnknownModel` when it is not configured."""
        return self.models[self.model_key(name)]

    def queue_for(self, name: str) -> str:
        """Celery queue that carries requests for model ``name``."""
        key = self.model_key(name)
        return self.models[key].queue or f"fleet.{key}"

    def canary_queue_for(self, name: str) -> str:
        """Celery queue that carries model ``name``'s canary traffic: its queue + ``.canary``."""
        return self.queue_for(name) + ".canary"

    def direct_queue_for(self, name: str, hostname: str) -> str:
        """The queue of one worker (``hostname``, its Celery node name) of model ``name``: its queue +
        ``.w.`` + hostname, where prefix-aware routing sends the requests whose prefix it holds."""
        return self.queue_for(name) + DIRECT_QUEUE_INFIX + hostname


DIRECT_QUEUE_INFIX = ".w."
"""Between a model's queue and a worker's hostname in the name of that worker's own queue."""


def shared_queue_of(queue: str) -> str:
    """The model's queue for ``queue``: itself, or, for a worker's own queue, the queue it was routed from
    (where a requeued message goes, so that a live worker takes it)."""
    return queue.split(DIRECT_QUEUE_INFIX, 1)[0]


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def load_settings(config_path: Path | str | None = None, **overrides: Any) -> FleetSettings:
    """Build the process's settings from YAML + environment (+ explicit overrides, highest).

    Args:
        config_path: YAML file; defaults to ``$FLEET_CONFIG`` or ``configs/fleet.yaml`` (missing
            default file = built-in defaults only).
        overrides: top-level fields that beat every other source, ``FLEET_*`` variables included
            (used by CLI flags); a section given as a dict is merged into the section field by field.

    Raises:
        ConfigError: a value broke a rule; the message names the setting (dotted path) and the rule (and
            starts ``override refused:`` when an override broke it).
    """
    path = Path(config_path or os.environ.get("FLEET_CONFIG") or DEFAULT_CONFIG_PATH)
    data: dict[str, Any] = {"models": {}}
    if path.exists():
        loaded = _read_yaml(path)
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping", "FLEET_CONFIG", "mapping")
        data = {"models": {}, **loaded}
        _resolve_model_paths(data, path.parent)
    elif config_path is not None or "FLEET_CONFIG" in os.environ:
        raise ConfigError(f"config file {path} does not exist", "FLEET_CONFIG", str(path))
    _name_env_only_models(data)
    _warn_unknown_env()
    try:
        settings = FleetSettings(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc), _first_loc(exc), None) from exc
    if overrides:
        merged = deep_merge(settings.model_dump(), overrides)
        token = _OVERRIDING.set(True)  # env and YAML are in ``merged`` already: the environment must not win again
        try:
            settings = FleetSettings(**merged)
        except ValidationError as exc:
            raise ConfigError(f"override refused: {_describe(exc)}", _first_loc(exc), None) from exc
        finally:
            _OVERRIDING.reset(token)
    return settings


_OVERRIDING: contextvars.ContextVar[bool] = contextvars.ContextVar("fleet_settings_overriding", default=False)
"""True while :func:`load_settings` applies its overrides: :class:`FleetSettings` then reads no environment."""


NOT_SETTINGS_ENV = frozenset({"FLEET_CONFIG", "FLEET_DEBUG", "FLEET_ORT", "FLEET_GIT_COMMIT", "FLEET_BENCH_PROVIDER",
                              "FLEET_FUZZ_ENVELOPES", "FLEET_API_KEYS"})  # fmt: skip
"""``FLEET_*`` variables that are not settings: the config file, ``--debug``, the install's ONNX Runtime build,
the bench's provider and commit, the fuzz tests' size, docker compose's API keys."""
_warned_env: set[str] = set()


def _warn_unknown_env() -> None:
    """Log (once per process) each ``FLEET_*`` variable that names no setting: pydantic-settings ignores it,
    so a typo (``FLEET_WORKER_CONCURRENCY``, one underscore) silently left the default in force. A nested
    name that does not exist (``FLEET_WORKER__BOGUS``) is refused by the settings themselves."""
    for var in os.environ:
        name = var.upper()
        if not name.startswith("FLEET_") or name in NOT_SETTINGS_ENV or name in _warned_env:
            continue
        if name[len("FLEET_"):].split("__", 1)[0].lower() in FleetSettings.model_fields:
            continue
        _warned_env.add(name)
        meant = _meant(name[len("FLEET_"):].lower())
        hint = f" (did you mean {meant}?)" if meant else ""
        logging.getLogger("fleet.settings").warning("environment variable %s is not a setting and is ignored%s",
                                                    var, hint)  # fmt: skip


def _meant(rest: str) -> str | None:
    """The setting's variable a mistyped ``FLEET_<rest>`` most likely meant: a section's field written with
    one underscore (``worker_concurrency`` → ``FLEET_WORKER__CONCURRENCY``), else a close top-level name."""
    for name, field in FleetSettings.model_fields.items():
        section = field.annotation
        sub = rest[len(name) + 1 :]
        is_section = isinstance(section, type) and issubclass(section, BaseModel)
        if rest.startswith(name + "_") and is_section and sub in section.model_fields:  # type: ignore[union-attr]
            return f"FLEET_{name.upper()}__{sub.upper()}"
    close = difflib.get_close_matches(rest, list(FleetSettings.model_fields), 1, 0.75)
    return f"FLEET_{close[0].upper()}" if close else None


def _read_yaml(path: Path) -> Any:
    """The parsed YAML file; a syntax error or an unreadable file becomes one ConfigError naming the file.

    Raises:
        ConfigError: the file is not valid YAML (file, line, column and the parser's reason) or cannot be read.
    """
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {where}: invalid YAML: {reason}; fix the file or point FLEET_CONFIG "
                          "at another one", "FLEET_CONFIG", "valid YAML") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}", "FLEET_CONFIG", "a readable file") from exc


def _name_env_only_models(data: dict[str, Any]) -> None:
    """Give a model named only in the environment its hyphenated name.

    Environment variable names cannot hold ``-``, so ``FLEET_MODELS__BENCH_LM__PATH`` names model
    ``bench-lm`` (queue ``fleet.bench-lm``), the spelling every command and the docs use, unless the
    YAML file spells that model otherwise (then the YAML spelling is kept).
    """
    if not isinstance(data.get("models"), dict):
        return
    known = {_norm(str(k)) for k in data["models"]}
    prefix = "FLEET_MODELS__"
    for var in os.environ:
        if not var.upper().startswith(prefix) or "__" not in var[len(prefix):]:
            continue
        name = var[len(prefix):].split("__", 1)[0].lower().replace("_", "-")
        if name and _norm(name) not in known:
            data["models"][name] = {}
            known.add(_norm(name))


def _resolve_model_paths(data: dict[str, Any], base: Path) -> None:
    """Relative model paths (and TensorRT cache folders) in a YAML file are relative to its folder."""
    for model in (data.get("models") or {}).values():
        if not isinstance(model, dict):
            continue
        if model.get("path") is not None and not Path(str(model["path"])).is_absolute():
            model["path"] = str((base / str(model["path"])).resolve())
        engine = model.get("engine")
        if (
            isinstance(engine, dict)
            and "cache_dir" in engine
            and not Path(str(engine["cache_dir"])).is_absolute()
        ):
            engine["cache_dir"] = str((base / str(engine["cache_dir"])).resolve())


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, nested dicts merged key by key (neither input changes)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _first_loc(exc: ValidationError) -> str:
    errs = exc.errors()
    return ".".join(str(p) for p in errs[0]["loc"]) if errs else "settings"


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not err["loc"]:  # a rule across several settings: its message names them
            lines.append(f"invalid settings: {msg}")
            continue
        loc = ".".join(str(p) for p in err["loc"])
        env = "FLEET_" + "__".join(str(p).upper().replace("-", "_") for p in err["loc"])
        lines.append(f"invalid setting {loc} ({env}): {msg}")
    return "; ".join(lines)
