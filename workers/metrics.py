"""Worker metrics: Prometheus series and the queue drain meter, fed by hooks only.

Nothing here runs inside the scheduler loop. Batches arrive through
:meth:`workers.scheduler.Scheduler.add_observer`; requests through Celery's signals
(``task_prerun``, ``task_success``, ``task_failure``, ``task_revoked``). A ``fleet.infer_bulk``
message counts as the requests it carries: each is dequeued for the drain meter, counted by outcome
and observed for queue wait from the bulk task's summary (:func:`workers.bulk.summarize`); a bulk
message too malformed to run counts once, as the failure it is.

Series (label ``model`` on each; times in seconds, as Prometheus expects):

==========================================  ==========  ==================================================
``fleet_worker_requests_total``             counter     requests finished, by ``outcome``: succeeded,
                                                        invalid, expired, cancelled, failed
``fleet_worker_queue_wait_seconds``         histogram   producer submit → batch start
``fleet_worker_batches_total``              counter     batches run, by policy ``reason``
``fleet_worker_batch_size``                 histogram   sequences per batch
``fleet_worker_padding_efficiency``         histogram   real tokens / padded tokens, per batch (0–1]
``fleet_worker_tokens_total``               counter     tokens computed, ``kind`` = real | padded
``fleet_worker_inference_seconds``          histogram   engine time per batch
``fleet_worker_tokens_per_second``          histogram   real tokens / engine time, per batch
``fleet_worker_in_flight``                  gauge       requests held (tokens of C in use)
``fleet_worker_ready``                      gauge       1 once the worker consumes
``fleet_worker_computed_total``             counter     requests computed, by ``version`` (the model
                                                        version that ran them), ``role`` (stable |
                                                        canary) and ``outcome`` (ok | failed)
``fleet_worker_latency_seconds``            histogram   producer submit → end of its batch, by
                                                        ``version`` and ``role``
``fleet_worker_generation_copies_total``    counter     deliveries of a generation ID that found it
                                                        stored (``outcome`` skipped), running elsewhere
                                                        (waited) or orphaned (took_over):
                                                        :mod:`workers.run_claims`
``fleet_engine_nodes``                      gauge       nodes of the served graph per execution
                                                        ``provider``, by ``version`` (stable and
                                                        canary engines; counted at load:
                                                        ``engine.report_placement``)
==========================================  ==========  ==================================================

The per-version series come from the scheduler's outcome hook (every batch, whatever the model
state); ``fleet_worker_batches_total`` carries ``version`` too. The series above them keep only
``model`` (and their own label), so existing queries and dashboards are unchanged.

Generation series (time to first token, inter-token time, generated tokens, running sequences,
KV tokens, finish reasons) are in :mod:`workers.generation_metrics`; the stream publisher's (events
published, held while Redis does not answer, dropped) in :mod:`workers.stream_metrics`.

``rate(fleet_worker_tokens_total{kind="real"}[1m])`` is the worker's served tokens/s. The endpoint
(``worker.metrics_port``; 0 = off) binds ``worker.metrics_host`` (default: the gateway's ``api.host``,
127.0.0.1) and is plain HTTP without auth, like most exporters: keep it on a
private network. The drain meter counts requests taken off the queue per wall-clock second
(``fleet:drain:<model>:<second>`` in Redis, written twice a second: :mod:`workers.drain_meter`), from
which admission control estimates Retry-After.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from celery import signals
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from protocol.errors import InvalidRequest, RequestCancelled, RequestExpired
from protocol.messages import BULK_TASK_NAME, TASK_NAME
from workers.drain_meter import DrainMeter
from workers.generation_metrics import TIME_BUCKETS, GenerationMetrics
from workers.run_claims import RunClaimsCollector
from workers.runtime import WorkerRuntime
from workers.scheduler import BatchStats, JobOutcome
from workers.stream_metrics import StreamPublisherCollector

__all__ = ["EngineNodesCollector", "WorkerMetrics", "install_metrics", "outcome_of", "queue_wait_ms_of",
           "ready_as_published"]

log = logging.getLogger("fleet.metrics")

SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
RATE_BUCKETS = (100, 300, 1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000)


def queue_wait_ms_of(result: Any) -> float | None:
    """A request result's ``timings.queue_wait_ms`` (producer submit → batch start), None if absent."""
    wait_ms = (result.get("timings") or {}).get("queue_wait_ms") if isinstance(result, dict) else None
    return float(wait_ms) if isinstance(wait_ms, int | float) else None


def outcome_of(exc: BaseException | None) -> str:
    """The ``outcome`` label of a finished request: succeeded, invalid, expired, cancelled or failed."""
    if exc is None:
        return "succeeded"
    if isinstance(exc, RequestExpired):
        return "expired"
    if isinstance(exc, RequestCancelled):
        return "cancelled"
    if isinstance(exc, InvalidRequest):
        return "invalid"
    return "failed"


def ready_as_published(runtime: WorkerRuntime) -> bool:
    """What the worker's heartbeat says of its readiness, as ``fleet probe ready`` reads it: ``runtime.ready``
    (it consumes, it is not shutting down, the threads it needs live, its engine's runs do not all fail, and
    as of the last check it is not stalled: :mod:`workers.progress`), and its last beat reached Redis (it
    cannot take or store anything while Redis is away; the gauge said 1 through an outage)."""
    return runtime.ready and runtime.heartbeat.live


class EngineNodesCollector:
    """``fleet_engine_nodes{model,version,provider}``: the node placement of the engines loaded now
    (read at each scrape, so a swapped or dropped version follows)."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "fleet_engine_nodes",
            "Nodes of the served graph per execution provider (counted at load).",
            labels=["model", "version", "provider"],
        )
        for loaded in (self.runtime.stable, self.runtime.canary):
            if loaded is None or loaded.engine.placement is None:
                continue
            for provider, count in loaded.engine.placement.items():
                family.add_metric([self.runtime.model_key, loaded.version, provider], count)
        yield family


class WorkerMetrics:
    """The series of one worker process, registered in ``registry``."""

    def __init__(self, runtime: WorkerRuntime, registry: CollectorRegistry) -> None:
        self.runtime = runtime
        self.drain = DrainMeter(runtime.model_key, lambda: runtime.redis, runtime.settings.admission.drain_window_s)
        self.model = runtime.model_key
        m = ["model"]
        self.requests = Counter(
            "fleet_worker_requests", "Requests finished, by outcome.", [*m, "outcome"], registry=registry
        )
        self.queue_wait = Histogram(
            "fleet_worker_queue_wait_seconds",
            "Producer submit to batch start (s).",
            m,
            buckets=TIME_BUCKETS,
            registry=registry,
        )
        self.batches = Counter(
            "fleet_worker_batches", "Batches run.", [*m, "reason", "version"], registry=registry
        )
        self.computed = Counter(
            "fleet_worker_computed", "Requests computed, by model version, role and outcome (ok | failed).",
            [*m, "version", "role", "outcome"], registry=registry,
        )
        self.latency = Histogram(
            "fleet_worker_latency_seconds", "Producer submit to the end of its batch, by version and role (s).",
            [*m, "version", "role"], buckets=TIME_BUCKETS, registry=registry,
        )
        self.batch_size = Histogram(
            "fleet_worker_batch_size", "Sequences per batch.", m, buckets=SIZE_BUCKETS, registry=registry
        )
        self.padding = Histogram(
            "fleet_worker_padding_efficiency",
            "Real tokens / padded tokens per batch.",
            m,
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "fleet_worker_tokens", "Tokens computed (real or padded).", [*m, "kind"], registry=registry
        )
        self.inference = Histogram(
            "fleet_worker_inference_seconds",
            "Engine time per batch (s).",
            m,
            buckets=TIME_BUCKETS,
            registry=registry,
        )
        self.tokens_per_s = Histogram(
            "fleet_worker_tokens_per_second",
            "Real tokens / engine time per batch.",
            m,
            buckets=RATE_BUCKETS,
            registry=registry,
        )
        Gauge("fleet_worker_in_flight", "Requests held.", m, registry=registry).labels(self.model).set_function(
            lambda: float(runtime.in_flight)
        )
        Gauge("fleet_worker_ready", "1 while the worker's heartbeat says ready: it consumes, it progresses what it "
              "holds, and Redis took its last beat.", m, registry=registry).labels(
            self.model
        ).set_function(lambda: 1.0 if ready_as_published(runtime) else 0.0)
        for outcome in ("succeeded", "invalid", "expired", "cancelled", "failed"):
            self.requests.labels(self.model, outcome)  # export zeros, so rate() sees the series start
        registry.register(StreamPublisherCollector(self.model, runtime.streams))  # held/dropped stream events
        registry.register(EngineNodesCollector(runtime))
        registry.register(RunClaimsCollector(self.model, runtime.run_claims))  # copies of a generation's ID
        loop = runtime.scheduler.generation
        scheduler = runtime.scheduler
        self.generation = (
            GenerationMetrics(self.model, loop, registry, lambda: scheduler.generation) if loop is not None else None
        )

    # -- hooks ---------------------------------------------------------------------------------
    def on_batch(self, stats: BatchStats) -> None:
        """Scheduler observer: one batch ran."""
        self.batches.labels(self.model, stats.reason, stats.version).inc()
        self.batch_size.labels(self.model).observe(stats.size)
        self.tokens.labels(self.model, "real").inc(stats.real_tokens)
        self.tokens.labels(self.model, "padded").inc(stats.padded_tokens)
        if stats.padded_tokens > 0:
            self.padding.labels(self.model).observe(stats.real_tokens / stats.padded_tokens)
        seconds = stats.inference_ms / 1000
        self.inference.labels(self.model).observe(seconds)
        if seconds > 0:
            self.tokens_per_s.labels(self.model).observe(stats.real_tokens / seconds)

    def on_outcomes(self, outcomes: list[JobOutcome]) -> None:
        """Scheduler outcome observer: every request of one batch, with the version that computed it."""
        now = time.time()
        for o in outcomes:
            self.computed.labels(self.model, o.version, o.role, "ok" if o.ok else "failed").inc()
            if o.submitted_unix_s is not None:
                self.latency.labels(self.model, o.version, o.role).observe(max(0.0, now - o.submitted_unix_s))

    def on_dequeued(self, count: int = 1) -> None:
        """``count`` requests left the queue for this worker: count them for the drain meter
        (in memory; :class:`workers.drain_meter.DrainMeter` writes them to Redis twice a second)."""
        self.drain.add(count)

    def on_finished(self, result: Any, exc: BaseException | None) -> None:
        """A request finished (``exc`` None = success with ``result``, the task's JSON value)."""
        self.requests.labels(self.model, outcome_of(exc)).inc()
        wait_ms = queue_wait_ms_of(result) if exc is None else None
        if wait_ms is not None:
            self.queue_wait.labels(self.model).observe(wait_ms / 1000)
        if exc is None and self.generation is not None:
            self.generation.on_result(result)

    def on_bulk_finished(self, summary: Any) -> None:
        """A ``fleet.infer_bulk`` message finished: count each of its requests like a ``fleet.infer`` one."""
        if not isinstance(summary, dict):
            return
        for outcome, count in (summary.get("outcomes") or {}).items():
            if isinstance(count, int) and count > 0:
                self.requests.labels(self.model, str(outcome)).inc(count)
        for wait_ms in summary.get("queue_wait_ms") or ():
            if isinstance(wait_ms, int | float):
                self.queue_wait.labels(self.model).observe(wait_ms / 1000)


_installed: WorkerMetrics | None = None


def install_metrics(runtime: WorkerRuntime, registry: CollectorRegistry | None = None) -> WorkerMetrics:
    """Wire metrics into this worker process (once): scheduler observer, Celery signals, HTTP port.

    Raises:
        OSError: ``worker.metrics_port`` is set and cannot be bound.
    """
    global _installed
    if _installed is not None:
        return _installed
    from prometheus_client import REGISTRY

    from workers.progress import ProgressCollector
    from workers.trace_guard import outside_body_errors

    metrics = WorkerMetrics(runtime, registry or REGISTRY)
    runtime.scheduler.add_observer(metrics.on_batch)
    runtime.scheduler.add_outcome_observer(metrics.on_outcomes)
    _connect_signals(metrics)
    (registry or REGISTRY).register(ProgressCollector(runtime.model_key, runtime.progress, outside_body_errors))
    port = runtime.settings.worker.metrics_port
    if port:
        host = runtime.settings.worker.metrics_host or runtime.settings.api.host
        start_http_server(port, addr=host, registry=registry or REGISTRY)
        log.info("Prometheus metrics on %s:%d/metrics (plain HTTP, no auth)", host, port)
    _installed = metrics
    return metrics


def _bulk_request_count(args: Any) -> int:
    """Requests carried by a ``fleet.infer_bulk`` message with these task ``args`` (0 if malformed)."""
    if isinstance(args, list | tuple) and len(args) == 1 and isinstance(args[0], dict):
        requests = args[0].get("requests")
        if isinstance(requests, list):
            return len(requests)
    return 0


def _connect_signals(metrics: WorkerMetrics) -> None:
    def ours(sender: Any) -> bool:
        return getattr(sender, "name", None) in (TASK_NAME, BULK_TASK_NAME)

    def bulk(sender: Any) -> bool:
        return getattr(sender, "name", None) == BULK_TASK_NAME

    def prerun(sender: Any = None, args: Any = None, **_: Any) -> None:
        if ours(sender):
            metrics.on_dequeued(_bulk_request_count(args) if bulk(sender) else 1)

    def success(sender: Any = None, result: Any = None, **_: Any) -> None:
        if bulk(sender):
            metrics.on_bulk_finished(result)
        elif ours(sender):
            metrics.on_finished(result, None)

    def failure(sender: Any = None, exception: BaseException | None = None, **_: Any) -> None:
        if ours(sender):
            metrics.on_finished(None, exception or Exception("unknown failure"))

    def revoked(sender: Any = None, **_: Any) -> None:
        if ours(sender):
            metrics.on_finished(None, RequestCancelled("revoked", "request_id", None))

    # weak=False: the closures live only here; Celery would otherwise drop them at once
    signals.task_prerun.connect(prerun, weak=False)
    signals.task_success.connect(success, weak=False)
    signals.task_failure.connect(failure, weak=False)
    signals.task_revoked.connect(revoked, weak=False)
    signals.worker_shutdown.connect(lambda **_: metrics.drain.close(), weak=False)
