"""The Celery application, configured from settings; ``celery -A workers.app worker`` loads it.

One worker process serves one model (``FLEET_WORKER__MODEL``) from that model's queue, with the
threads pool and concurrency C = the token bucket. ``worker_prefetch_multiplier=1`` and
``acks_late`` keep excess load in Redis, where any worker can take it; a SIGKILLed worker's
unacked requests come back after ``visibility_timeout_s``. JSON only: no pickle anywhere.

Producers use :func:`broker.make_celery`, the same configuration without tasks or ORT.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from celery import Celery, signals

from broker import (
    check_broker_versions,
    install_event_buffer,
    install_poison_guard,
    install_result_backend,
    make_celery,
    quiet_worker,
)
from protocol.celeryconf import celery_config
from protocol.errors import ConfigError, FleetError
from protocol.log_format import TEXT_FORMAT, JsonFormatter, configure_logging
from protocol.process_gc import freeze_startup_objects
from protocol.settings import FleetSettings, load_settings

__all__ = ["SETTINGS", "app", "create_app"]

log = logging.getLogger("fleet.worker")


def create_app(settings: FleetSettings, *, name: str = "onnx-fleet") -> Celery:
    """A Celery app bound to ``settings`` with the ``fleet.infer`` task registered."""
    celery_app = make_celery(celery_config(settings), name)
    from workers.tasks import consume_direct_queue, register_tasks

    install_result_backend(celery_app)
    install_event_buffer(celery_app, settings.celery.task_event_linger_ms)

    register_tasks(celery_app)
    consume_direct_queue(celery_app, settings)
    return celery_app


def _settings_or_exit() -> FleetSettings:
    """The settings, or exit 2 with one line naming the setting (``celery -A workers.app`` has no ``fleet`` CLI
    around it to say it): a value that breaks a rule, or a ``FLEET_*`` variable that is not the JSON its
    setting takes (:mod:`protocol.settings_env`)."""
    try:
        return load_settings()
    except ConfigError as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def _tested_broker_or_exit(settings: FleetSettings) -> None:
    """Refuse (exit 3) a celery or kombu outside the tested versions before any of their internals are
    adapted (:mod:`broker.versions`); ``worker.allow_untested_kombu`` starts anyway, warned."""
    try:
        check_broker_versions(settings.worker.allow_untested_kombu)
    except ConfigError as exc:
        print(f"fleet worker: cannot start: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(3) from exc


SETTINGS = _settings_or_exit()
"""This process's settings, built once at import (``celery -A workers.app`` imports this module)."""
if SETTINGS.log.format == "json":  # from the first line: Celery warns (SecurityWarning) before it sets up logging
    configure_logging("json", SETTINGS.worker.loglevel)
    logging.captureWarnings(True)
_tested_broker_or_exit(SETTINGS)
app = create_app(SETTINGS)


def _runtime_settings() -> FleetSettings | None:
    """The settings of this worker's runtime (None before it is built): the poison guard's configuration."""
    from workers.runtime import current_runtime

    runtime = current_runtime()
    return runtime.settings if runtime is not None else None


@signals.worker_init.connect  # type: ignore[untyped-decorator]
def _load_model_before_consuming(sender: Any = None, **_: Any) -> None:
    """Load and warm the model before the consumer starts; any failure stops the worker (exit 3)."""
    if getattr(sender, "app", None) is not app:
        return
    from producer.redis_preflight import checked_already, refuse_wrong_url

    # a bare `celery -A workers.app worker` checks here; `fleet worker` checked in this process before it became Celery
    if not checked_already() and (code := refuse_wrong_url(SETTINGS, "fleet worker")) is not None:
        os._exit(code)  # else Celery's consumer retries a URL that can never work; SystemExit would be swallowed
    from workers.result_repr import install as install_result_repr
    from workers.runtime import start_runtime

    quiet_worker(sender)  # no mingle, no gossip, as `fleet worker` starts it (broker.celery_app)
    install_poison_guard(worker_settings=_runtime_settings)
    install_result_repr()  # the task-succeeded event's result text, without Celery's slow saferepr

    if SETTINGS.log.format == "text":  # json: configured at import
        logging.basicConfig(level=SETTINGS.worker.loglevel, format=TEXT_FORMAT)
    try:
        runtime = start_runtime(
            SETTINGS,
            hostname=str(sender.hostname),
            concurrency=int(sender.concurrency or 0),
            pool=str(getattr(sender, "pool_cls", "")),
        )
        from workers.metrics import install_metrics

        install_metrics(runtime)  # scheduler observer + Celery signals + the metrics port
        runtime.heartbeat.on_beat.append(_sweep_redis_pools)
    except Exception as exc:  # any start-up failure must stop the worker, never leave it half-built
        log.critical("worker cannot start: %s", exc, exc_info=not isinstance(exc, FleetError))
        print(f"fleet worker: cannot start: {exc}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(3)  # SystemExit would be swallowed by the blueprint; nothing runs yet to clean up


def _sweep_redis_pools(_expires_unix_s: float) -> None:
    """After each heartbeat: release the sockets a Redis restart closed in every pool of the process, those
    rarely used (the result backend's) included (:func:`protocol.redis_pools.sweep_process_pools`)."""
    from protocol.redis_pools import sweep_process_pools

    sweep_process_pools()


@signals.after_setup_logger.connect  # type: ignore[untyped-decorator]
@signals.after_setup_task_logger.connect  # type: ignore[untyped-decorator]
def _json_log_lines(logger: logging.Logger | None = None, **_: Any) -> None:
    """With ``log.format: json``, every handler Celery set up writes JSON lines (protocol.log_format)."""
    if SETTINGS.log.format == "json" and logger is not None:
        for handler in logger.handlers:
            handler.setFormatter(JsonFormatter())


@signals.celeryd_after_setup.connect  # type: ignore[untyped-decorator]
def _banner_as_a_log_line(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """With ``log.format: json``, Celery's multi-line start-up banner (printed, not logged) becomes one
    JSON line saying the same: hostname, transport (password masked), queues, concurrency."""
    worker_app = getattr(instance, "app", None)
    if SETTINGS.log.format != "json" or worker_app is None or worker_app is not app:
        return
    instance.quiet = True
    queues = ",".join(sorted(q.name for q in worker_app.amqp.queues.consume_from.values()))
    uri = worker_app.connection().as_uri()
    log.info("celery worker %s: transport %s, queues %s, concurrency %s", sender, uri, queues,
             getattr(instance, "concurrency", "?"))  # fmt: skip


@signals.worker_ready.connect  # type: ignore[untyped-decorator]
def _announce_ready(sender: Any = None, **_: Any) -> None:
    from workers.runtime import current_runtime

    runtime = current_runtime()
    if runtime is not None:
        freeze_startup_objects(log, "worker")  # a full collection would stop every thread (protocol.process_gc)
        runtime.mark_ready()


@signals.worker_shutting_down.connect  # type: ignore[untyped-decorator]
def _abandon_claim_waits(sender: Any = None, **_: Any) -> None:
    """A shutdown begins (the signal handler of SIGTERM/SIGINT/SIGQUIT): deliveries waiting on another worker's
    generation go back to the queue instead of keeping a warm shutdown waiting for that generation's end."""
    from workers.runtime import current_runtime

    runtime = current_runtime()
    if runtime is not None:
        runtime.run_claims.abandon_waits()


@signals.worker_shutdown.connect  # type: ignore[untyped-decorator]
def _stop_runtime(sender: Any = None, **_: Any) -> None:
    from workers.runtime import stop_runtime

    stop_runtime()
