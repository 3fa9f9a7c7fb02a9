"""The per-process worker runtime: settings, model card, engine, scheduler and heartbeat.

Built once at ``worker_init`` (before the consumer starts), so a worker never takes a request
before its model is loaded and warmed up. Task threads reach it through :func:`current_runtime`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import redis
from celery.worker import state as worker_state

from protocol.errors import ConfigError, ModelLoadError
from protocol.generation_config import load_generation_defaults
from protocol.keys import CARD_KEY
from protocol.modelcard import ModelCard, load_card
from protocol.redis_conn import sync_client
from protocol.settings import FleetSettings, ModelSettings
from protocol.tokenization import Tokenizer, load_tokenizer
from store.resolve import resolve_model
from workers.engine import Engine
from workers.generation.decoder import Decoder
from workers.generation.loop import GenerationLoop
from workers.health import Heartbeat
from workers.policy import BatchPolicy
from workers.scheduler import Scheduler
from workers.stream_publisher import StreamPublisher

__all__ = ["WorkerRuntime", "current_runtime", "start_runtime", "stop_runtime"]

log = logging.getLogger("fleet.worker")

_runtime: WorkerRuntime | None = None
_lock = threading.Lock()


class WorkerRuntime:
    """Everything one worker process holds for its one model."""

    def __init__(self, settings: FleetSettings, hostname: str, concurrency: int) -> None:
        self.settings = settings
        self.hostname = hostname
        self.concurrency = concurrency
        self.model_key = settings.model_key(settings.worker.model)
        self.model: ModelSettings = settings.models[self.model_key]
        self.queue = settings.queue_for(self.model_key)
        if concurrency < self.model.batching.max_batch_size:
            raise ConfigError(
                f"worker concurrency {concurrency} < models.{self.model_key}.batching.max_batch_size "
                f"{self.model.batching.max_batch_size}: a batch can never exceed the tokens a worker holds; "
                "raise -c/--concurrency (FLEET_WORKER__CONCURRENCY) or lower max_batch_size",
                "worker.concurrency",
                self.model.batching.max_batch_size,
            )
        # model store hook (store/): with models.<m>.store_version set, path = the cached copy fetched and
        # verified against the version's manifest (ChecksumMismatch, a ModelLoadError, stops the start)
        self.model = resolve_model(settings, self.model_key)
        self.card: ModelCard = load_card(self.model.path)
        self.version = self.model.version or self.card.version
        self.engine = Engine(
            self.model.path, self.card, self.model.engine, self.model.batching, self.model.limits
        )
        self.warmup_ms = self.engine.warm_up() if self.model.engine.warmup else 0.0
        self.tokenizer: Tokenizer | None = _worker_tokenizer(self.card, self.model.path)
        self.eos_token_ids = _eos_token_ids(self.card, self.model.path)
        b = self.model.batching
        self.scheduler = Scheduler(
            self.engine,
            BatchPolicy(b.max_batch_size, b.max_wait_ms, b.max_batch_tokens, b.close_when_idle),
            backlog=_celery_backlog,
            generation=_generation_loop(self.engine, self.model),
        )
        if self.scheduler.generation is not None and self.model.engine.warmup:
            self.warmup_ms += self.scheduler.generation.warm_up()
        self.ready = False
        self.in_flight = 0
        self._count_lock = threading.Lock()
        self.started_unix_s = time.time()
        self.redis = sync_client(settings, socket_timeout=10)
        self.streams = StreamPublisher(
            sync_client(settings, socket_timeout=10),
            ttl_s=settings.result_ttl_s,
            max_len=self.model.limits.max_new_tokens + 16,
        )
        self.heartbeat = Heartbeat(self.redis, hostname, self.snapshot, settings.worker.heartbeat_s)

    def start(self) -> None:
        """Start the scheduler thread, publish the model card and the first heartbeat."""
        self.scheduler.start()
        self.streams.start()
        try:
            self.redis.set(CARD_KEY.format(model=self.model_key), self.card.model_dump_json())
        except redis.RedisError as exc:
            log.warning("could not publish the model card: %s", exc)
        self.heartbeat.start()
        log.info(
            "worker %s serves model %s %s from queue %s with %d tokens on %s",
            self.hostname,
            self.model_key,
            self.version,
            self.queue,
            self.concurrency,
            self.engine.providers,
        )

    def mark_ready(self) -> None:
        """Called once the consumer runs: the worker now takes requests."""
        self.ready = True
        self.heartbeat.beat()
        log.info("worker %s is ready (warm-up %.0f ms)", self.hostname, self.warmup_ms)

    def stop(self) -> None:
        """Drain the scheduler and withdraw the heartbeat."""
        self.ready = False
        self.scheduler.stop()
        self.streams.stop()
        self.heartbeat.stop()

    def token_taken(self) -> None:
        """A task thread took a request off the queue (one token of C is in use)."""
        with self._count_lock:
            self.in_flight += 1

    def token_returned(self) -> None:
        """A task thread finished its request (result written or failure recorded)."""
        with self._count_lock:
            self.in_flight -= 1

    def snapshot(self) -> dict[str, Any]:
        """The heartbeat document (see :mod:`workers.health`)."""
        return {
            "hostname": self.hostname,
            "pid": os.getpid(),
            "model": self.model_key,
            "version": self.version,
            "queue": self.queue,
            "providers": self.engine.providers,
            "ready": self.ready,
            "warm": self.model.engine.warmup,
            "concurrency": self.concurrency,
            "in_flight": self.in_flight,
            "batches_run": self.scheduler.batches_run,
            "generating": self.scheduler.generating,
            "can_generate": self.scheduler.generation is not None,
            "started_unix_s": self.started_unix_s,
            "max_batch_size": self.model.batching.max_batch_size,
        }


def _generation_loop(engine: Engine, model: ModelSettings) -> GenerationLoop | None:
    """The continuous-batching loop for a causal LM with a KV cache; None for other models."""
    if engine.card.kind != "causal_lm" or not engine.has_kv_cache:
        return None
    return GenerationLoop(Decoder(engine), model.batching)


def _worker_tokenizer(card: ModelCard, model_path: Path) -> Tokenizer | None:
    """The model's tokenizer for generated text and stop strings; None when it has none."""
    try:
        return load_tokenizer(card, model_path.parent)
    except Exception as exc:  # no tokenizer: generations return ids only
        log.warning("model %s has no usable tokenizer (%s): generations return token ids without text", card.name, exc)
        return None


def _eos_token_ids(card: ModelCard, model_path: Path) -> frozenset[int]:
    """EOS ids from generation_config.json next to the model and the card."""
    return frozenset(load_generation_defaults(model_path, card).eos_token_ids)


def _celery_backlog() -> int:
    """Requests this worker has received from Redis but not yet started (reserved, not active)."""
    return max(0, len(worker_state.reserved_requests) - len(worker_state.active_requests))


def start_runtime(settings: FleetSettings, *, hostname: str, concurrency: int, pool: str) -> WorkerRuntime:
    """Build and start this process's runtime (once).

    Raises:
        ConfigError: wrong pool, too few tokens for the batch size, unknown model.
        ModelLoadError / ProviderUnavailable: the model cannot be served as configured.
    """
    global _runtime
    if "thread" not in pool.lower() and "solo" not in pool.lower():
        raise ConfigError(
            f"worker pool {pool!r} is not supported: use the threads pool (-P threads) so that one model "
            "copy per process serves all C tokens",
            "worker_pool",
            "threads",
        )
    if not settings.models:
        raise ConfigError("no models are configured (settings 'models')", "models", "at least one")
    with _lock:
        if _runtime is None:
            try:
                runtime = WorkerRuntime(settings, hostname, concurrency)
            except FileNotFoundError as exc:
                raise ModelLoadError(str(exc), "path", None) from exc
            runtime.start()
            _runtime = runtime
        return _runtime


def current_runtime() -> WorkerRuntime | None:
    """This process's runtime, or None outside a started worker."""
    return _runtime


def stop_runtime() -> None:
    """Stop the runtime if one was started."""
    global _runtime
    with _lock:
        if _runtime is not None:
            _runtime.stop()
            _runtime = None
