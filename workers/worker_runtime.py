"""One worker process's runtime: settings, loaded versions, scheduler and heartbeat (:class:`WorkerRuntime`).

Built once at ``worker_init`` (before the consumer starts, :func:`workers.runtime.start_runtime`), so a
worker never takes a request before its model is loaded and warmed up. It holds the stable version and,
while the model has a canary, the canary version (:class:`~workers.engines.LoadedModel` each);
:meth:`WorkerRuntime.swap` replaces either between batches. Which versions to hold is decided by
:mod:`workers.reconcile` from the state in Redis. What it counts for its scheduler and readiness is in
:mod:`workers.runtime_counts`; the heartbeat document (:meth:`WorkerRuntime.snapshot`, times in s) here.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import redis
from celery import signals
from celery.worker import state as worker_state
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker import TAKEN_IN_HAND
from protocol.celeryconf import consumes_direct_queue, restore_interval_s
from protocol.errors import ConfigError
from protocol.keys import CARD_KEY
from protocol.modelcard import ModelCard
from protocol.redis_conn import sync_client
from protocol.settings import FleetSettings, ModelSettings
from protocol.tokenization import Tokenizer
from workers.direct_queue import DirectQueue, PrefixHolder
from workers.engine import Engine
from workers.engines import LoadedModel
from workers.generation.loop import GenerationLoop
from workers.health import Heartbeat
from workers.held_requests import HeldRequests
from workers.namesakes import namesake_message
from workers.outcomes import OutcomeWriter
from workers.policy import BatchPolicy
from workers.progress import FailureStreak, ProgressReport, ProgressWatch, ThreadWatch, WorkerProgress, not_ready_reason
from workers.reconcile import Reconciler
from workers.run_claims import RunClaims, owner_of
from workers.runtime_counts import HOLD_DEPTH_TIMEOUT_S, RuntimeCounts
from workers.scheduler import Role, Scheduler
from workers.stream_publisher import StreamPublisher
from workers.trace_guard import off_traced, on_traced

__all__ = ["WorkerRuntime", "kv_cache_doc", "shutting_down"]

log = logging.getLogger("fleet.worker")


def shutting_down() -> bool:
    """True once this process's Celery worker began a warm or cold shutdown (its signal handler set
    ``should_stop`` or ``should_terminate``; an exit code, 0 included, or True): its consumer takes nothing
    more. Read as :func:`celery.worker.state.maybe_shutdown` reads them."""
    return any(flag is not None and flag is not False
               for flag in (worker_state.should_stop, worker_state.should_terminate))


def kv_cache_doc(loop: GenerationLoop | None) -> dict[str, Any] | None:
    """The heartbeat's ``kv_cache``: which KV cache the stable version generates on (``in_place`` or ``concat``),
    its element type, whether its decode steps replay CUDA graphs (``cuda_graphs``, :mod:`workers.cuda_graph`), and
    for the in-place one where its slots live and their bytes; None without generation."""
    if loop is None:
        return None
    doc: dict[str, Any] = {"cache": "in_place" if loop.kv.in_place else "concat",
                           "dtype": np.dtype(loop.decoder.kv_dtype).name, "cuda_graphs": loop.decoder.replays_graphs}
    slots = getattr(loop.kv, "cache", None)
    if slots is not None:
        doc.update(memory="device" if slots.on_device else "host", bytes=slots.nbytes)
    return doc


class WorkerRuntime(RuntimeCounts):
    """Everything one worker process holds for its one model."""

    def __init__(self, settings: FleetSettings, hostname: str, concurrency: int) -> None:
        self.settings = settings
        self.hostname = hostname
        self.concurrency = concurrency
        self.model_key = settings.model_key(settings.worker.model)
        configured: ModelSettings = settings.models[self.model_key]
        self.queue = settings.queue_for(self.model_key)
        self.canary_queue = settings.canary_queue_for(self.model_key)
        if concurrency < configured.batching.max_batch_size:
            raise ConfigError(
                f"worker concurrency {concurrency} < models.{self.model_key}.batching.max_batch_size "
                f"{configured.batching.max_batch_size}: a batch can never exceed the tokens a worker holds; "
                "raise -c/--concurrency (FLEET_WORKER__CONCURRENCY) or lower max_batch_size",
                "worker.concurrency",
                configured.batching.max_batch_size,
            )
        self.redis = sync_client(settings, socket_timeout=10)
        # The desired state in Redis wins over the config: a worker down during a change converges on start.
        self.reconciler = Reconciler(self.redis, settings, self.model_key, hostname)
        self.stable: LoadedModel = self.reconciler.initial()
        self.canary: LoadedModel | None = None
        self.warmup_ms = self.stable.warmup_ms
        b = configured.batching
        self.scheduler = Scheduler(
            self.stable.engine,
            BatchPolicy(b.max_batch_size, b.max_wait_ms, b.max_batch_tokens, b.close_when_idle),
            backlog=self._on_their_way,
            generation=self.stable.generation,
            version=self.stable.version,
            start_together_s=b.start_together_ms / 1000,
            queued=self._waiting_in_redis,
        )
        self._depth_redis = sync_client(  # no retries: a slow or unreachable Redis ends the wait at once
            settings, socket_timeout=HOLD_DEPTH_TIMEOUT_S, socket_connect_timeout=HOLD_DEPTH_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
        self._consuming = False
        self.in_flight = 0
        self._generation_steps = 0
        if self.stable.generation is not None:  # handed on to every later loop by swap()
            self.stable.generation.observers.append(self._count_generation_step)
        self._count_lock = threading.Lock()
        self.started_unix_s = time.time()
        self.streams = StreamPublisher(
            sync_client(settings, socket_timeout=10),
            ttl_s=settings.result_ttl_s,
            max_len=self.model.limits.max_new_tokens + 16,
            max_held_events=settings.worker.stream_hold_events,
            max_held_bytes=settings.worker.stream_hold_bytes,
            window_ms=settings.worker.stream_window_ms,
        )
        # two deliveries of one generation ID never run at once (workers.run_claims); a claim lives three beats
        self.run_claims = RunClaims(self.redis, owner=owner_of(hostname), ttl_s=3 * settings.worker.heartbeat_s)
        # readiness sees a worker that holds work it does not progress, whose engine fails every run, or whose
        # needed threads died (workers.progress); a change of it is published at once
        self.progress = WorkerProgress(
            ProgressWatch(settings.worker.stall_after_s, settings.worker.slot_grace_s, settings.visibility_timeout_s),
            work_done=self._work_done, queued=self._queued, held=self._held_for_progress,
            failures=FailureStreak(settings.worker.not_ready_after_failed_runs),
        )
        self.threads = ThreadWatch()
        self.shutdown_begun = False
        """A shutdown's signal came (:meth:`_shutdown_begins`), maybe before Celery's flags say so."""
        self.heartbeat = Heartbeat(self.redis, hostname, self.snapshot, settings.worker.heartbeat_s)
        self.scheduler.add_outcome_observer(self.progress.engine_outcomes)
        self.progress.on_failing.append(self.heartbeat.beat_soon)
        self.scheduler.on_death.append(self._scheduler_died)
        self.heartbeat.on_beat.append(self.run_claims.renew)
        self.heartbeat.on_ceded.append(self._name_taken)
        self.run_claims.on_ended_elsewhere = self.streams.cancels.flag  # its outcome is stored: stop it here
        # every worker keeps its own queue's name clean, consumed or not (workers.direct_queue)
        ttl_s = self.heartbeat.ttl_s
        self.direct_queue = DirectQueue(
            self.redis, model=self.model_key, hostname=hostname,
            name=settings.direct_queue_for(self.model_key, hostname), shared=self.queue,
            linger_s=settings.visibility_timeout_s + restore_interval_s(settings.visibility_timeout_s) + 2 * ttl_s,
            consumed=consumes_direct_queue(settings, self.model_key),
        )
        self.prefix_holder: PrefixHolder | None = None
        if self.direct_queue.consumed:
            self._route_by_prefix(hostname)
        self.heartbeat.on_beat.append(self._routing_beat)
        self.held = HeldRequests(self.redis, ttl_s=settings.result_ttl_s)
        """The requests this worker holds: each beat writes back what Redis lost of their bookkeeping."""
        self.heartbeat.on_beat.append(self.held.restore)
        self.scheduler.add_outcome_observer(
            OutcomeWriter(self.redis, self.model_key, lambda: self.reconciler.canary_active)
        )
        self.reconciler.attach(self)

    def _route_by_prefix(self, hostname: str) -> None:
        """Publish the stable prefix cache's digests, for the queue of our own we consume (workers.direct_queue)."""
        ttl_s = self.heartbeat.ttl_s
        # the set outlives a few late heartbeats (routers check liveness on their own): a starved heartbeat
        # thread must not drop what the worker holds
        self.prefix_holder = PrefixHolder(
            self.redis, model=self.model_key, hostname=hostname, ttl_s=max(60, 10 * ttl_s)
        )
        self._hold_prefixes(self.stable)
        self.streams.before_end = self.prefix_holder.sync  # a stream's last event, too, after the digests

    def _hold_prefixes(self, loaded: LoadedModel) -> None:
        """Publish ``loaded``'s prefix cache (the stable role's) from now on; what was published is void."""
        cache = loaded.generation.prefix_cache if loaded.generation is not None else None
        if self.prefix_holder is not None and cache is not None:
            cache.listener = self.prefix_holder

    def _routing_beat(self, expires_unix_s: float) -> None:
        self.direct_queue.beat(expires_unix_s)
        if self.prefix_holder is not None:
            self.prefix_holder.refresh()

    # The stable version's parts, as the pipeline validates requests against them.
    @property
    def model(self) -> ModelSettings:
        """``models.<m>`` of the stable version (``path`` = the file loaded)."""
        return self.stable.model

    @property
    def card(self) -> ModelCard:
        """The stable version's model card."""
        return self.stable.card

    @property
    def version(self) -> str:
        """The stable version (what results of the stable role report)."""
        return self.stable.version

    @property
    def engine(self) -> Engine:
        """The stable engine."""
        return self.stable.engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The stable version's tokenizer (None: generations return ids only)."""
        return self.stable.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """EOS ids of the stable version."""
        return self.stable.eos_token_ids

    def swap(self, role: Role, loaded: LoadedModel | None) -> None:
        """Serve ``role`` with ``loaded`` from the next batch on (None drops the canary).

        The old engine stays referenced by the batch (or generation) running on it and is freed when
        that ends.
        """
        if role == "stable":
            if loaded is None:
                raise ValueError("the stable role always has a model")
            old_loop = self.stable.generation
            if old_loop is not None and loaded.generation is not None:
                loaded.generation.observers.extend(old_loop.observers)  # metrics follow the new loop
            self.scheduler.swap("stable", loaded.engine, loaded.version, loaded.generation)
            if self.prefix_holder is not None:
                if old_loop is not None and old_loop.prefix_cache is not None:
                    old_loop.prefix_cache.listener = None
                self.prefix_holder.reset()
                self._hold_prefixes(loaded)
            self.stable = loaded
        else:
            stable_loop = self.stable.generation
            if loaded is not None and loaded.generation is not None and stable_loop is not None:
                loaded.generation.observers.extend(stable_loop.observers)  # generation metrics count it too
            self.scheduler.swap("canary", None if loaded is None else loaded.engine,
                                "" if loaded is None else loaded.version,
                                None if loaded is None else loaded.generation)
            self.canary = loaded
        self.heartbeat.beat(at_once=True)

    def start(self) -> None:
        """Start the scheduler thread, publish the model card and the first heartbeat, load a canary
        the state names, then follow the state (the reconciler thread).

        Raises:
            ConfigError: a live worker of another process claimed this worker's name first (both started
                at once; :mod:`workers.namesakes`): nothing was started.
        """
        holder = self.heartbeat.claim()
        if holder is not None:
            raise ConfigError(namesake_message(self.hostname, holder, self.model_key), "hostname",
                              "one live worker per name")  # fmt: skip
        self.scheduler.start()
        TAKEN_IN_HAND.subscribe(self.scheduler.wake)  # a take that brought nothing ends a wait for company
        self.streams.start()
        on_traced(self.streams.stored)  # a generation's stream ends once its result is stored
        on_traced(self.run_claims.release)
        self.direct_queue.start()  # what a SIGKILLed predecessor of this name left, before any take
        if self.prefix_holder is not None:
            self.prefix_holder.start()
        try:
            self.redis.set(CARD_KEY.format(model=self.model_key), self.card.model_dump_json())
        except redis.RedisError as exc:
            log.warning("could not publish the model card: %s", exc)
        self.heartbeat.on_beat.append(self._card_beat)
        signals.worker_shutting_down.connect(self._shutdown_begins, weak=False)
        self.heartbeat.start()
        self.reconciler.start()
        # the threads every request, stream, cancel and version change goes through (not the prefix holder's:
        # its digests are routing hints); the heartbeat's own death shows as its key expiring
        self.threads.watch(self.scheduler.thread, self.streams.thread, self.streams.cancels.thread,
                           self.reconciler.thread)
        log.info(
            "worker %s serves model %s %s from queues %s and %s with %d tokens on %s",
            self.hostname,
            self.model_key,
            self.version,
            self.queue,
            self.canary_queue,
            self.concurrency,
            self.engine.providers,
        )

    def _card_beat(self, _expires_unix_s: float) -> None:
        """Publish the model card again where Redis lost it (a restart without persistence, a flush): producers
        on machines without the model's files read its tokenizer and limits there. One ``SET NX`` per beat."""
        self.redis.set(CARD_KEY.format(model=self.model_key), self.card.model_dump_json(), nx=True)

    def _name_taken(self, holder: dict[str, Any]) -> None:
        """A live worker of another process took this worker's name while it did not beat (it was stopped, frozen,
        cut off from Redis): this one stops, as a second process under one name is refused at start
        (:mod:`workers.namesakes`). It could not be seen (no beat, no live entry, no probe), and the heartbeat
        hooks no longer renew its generations' claims or its deliveries' visibility, so every generation it took
        would run twice. The warm shutdown of a ``SIGTERM`` stops its consumer at once; what it holds ends as a
        warm shutdown ends it, and whatever it does not finish comes back to the queue."""
        log.error("worker %s: another process (pid %s) runs under this name now: this worker stops (warm shutdown) "
                  "and takes nothing more", self.hostname, holder.get("pid", "?"))  # fmt: skip
        os.kill(os.getpid(), signal.SIGTERM)

    def _shutdown_begins(self, sender: Any = None, **_: Any) -> None:
        """Celery's ``worker_shutting_down`` (in the signal handler of SIGTERM/SIGINT/SIGQUIT, before it sets the
        flags :func:`shutting_down` reads): not ready from now on, published at once, not at the next beat."""
        if sender is not None and str(sender) != self.hostname:
            return
        self.shutdown_begun = True
        self.heartbeat.beat_soon()

    def _scheduler_died(self) -> None:
        """The scheduler thread's notice of its death (on that thread, as it ends): not ready, written at once."""
        self.threads.ended(self.scheduler.thread)
        self.heartbeat.beat_soon()

    def not_ready_reason(self, report: ProgressReport | None = None) -> str | None:
        """Why the worker is not ready (:func:`workers.progress.not_ready_reason`), None when it is; ``report``
        is the progress watch's (default: the last beat's)."""
        return not_ready_reason(
            consuming=self._consuming, shutting_down=self.shutdown_begun or shutting_down(),
            dead_threads=self.threads.dead(), failures=self.progress.failures,
            report=self.progress.last if report is None else report, stall_after_s=self.progress.watch.stall_after_s,
        )

    @property
    def ready(self) -> bool:
        """The worker takes requests and serves them: its consumer runs (:meth:`mark_ready`), no shutdown has
        begun, its needed threads live, its engine does not fail every run, and (as of the last beat) it
        progresses what it holds. A warm shutdown (SIGTERM) stops taking at once and may drain its held work
        for minutes: not ready from its first moment, not from :meth:`stop` at its end."""
        return self.not_ready_reason() is None

    @ready.setter
    def ready(self, consuming: bool) -> None:
        self._consuming = consuming

    def mark_ready(self) -> None:
        """Called once the consumer runs: the worker now takes requests."""
        self.ready = True
        self.heartbeat.beat(at_once=True)
        log.info("worker %s is ready (warm-up %.0f ms)", self.hostname, self.warmup_ms)

    def stop(self) -> None:
        """Drain the scheduler and withdraw the heartbeat."""
        self.ready = False
        self.threads.closing()
        signals.worker_shutting_down.disconnect(self._shutdown_begins)
        self.reconciler.stop()
        TAKEN_IN_HAND.unsubscribe(self.scheduler.wake)
        self.scheduler.stop()
        off_traced(self.streams.stored)
        off_traced(self.run_claims.release)
        self.streams.stop()
        self.heartbeat.stop()
        if self.prefix_holder is not None:
            self.prefix_holder.stop()
        self.direct_queue.withdraw()

    def token_taken(self) -> None:
        """A task thread took a request off the queue (one token of C is in use)."""
        with self._count_lock:
            self.in_flight += 1

    def token_returned(self) -> None:
        """A task thread finished its request (result written or failure recorded)."""
        with self._count_lock:
            self.in_flight -= 1

    def snapshot(self) -> dict[str, Any]:
        """The heartbeat document (see :mod:`workers.health`); ``ready`` is :attr:`ready` with this beat's
        progress, ``not_ready`` why not (:meth:`not_ready_reason`, null when ready)."""
        progress = self.progress.check()
        why_not = self.not_ready_reason(progress)
        return {
            "hostname": self.hostname,
            "pid": os.getpid(),
            "model": self.model_key,
            "version": self.scheduler.stable.version,
            "version_since_unix_s": self.scheduler.stable.since_unix_s,
            "canary_version": self.canary.version if self.canary is not None else None,
            "last_refusal": self.reconciler.last_refusal,
            "queue": self.queue,
            "canary_queue": self.canary_queue,
            "direct_queue": self.direct_queue.name if self.direct_queue.consumed else None,
            "providers": self.engine.providers,
            "nodes": self.engine.placement,
            "kv_cache": kv_cache_doc(self.scheduler.generation),
            "ready": why_not is None,
            "not_ready": why_not,
            "shutting_down": self.shutdown_begun or shutting_down(),
            "failed_runs": self.progress.failures.failed_in_a_row,
            "dead_threads": self.threads.dead(),
            "held": progress.held,
            "stalled_s": round(progress.stalled_for_s, 1),
            "overdue_slots": progress.overdue,
            "warm": self.model.engine.warmup,
            "concurrency": self.concurrency,
            "in_flight": self.in_flight,
            "batches_run": self.scheduler.batches_run,
            "generating": self.scheduler.generating,
            "can_generate": self.scheduler.generation is not None,
            "started_unix_s": self.started_unix_s,
            "max_batch_size": self.model.batching.max_batch_size,
        }
