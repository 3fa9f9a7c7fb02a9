"""The Celery configuration both sides share (JSON only, reliability settings, routing).

:func:`celery_config` is handed to :func:`broker.make_celery`, which builds the app on the fleet's kombu
channel: ``protocol/`` sits below ``broker/`` and never imports it.
"""

from __future__ import annotations

from typing import Any

from kombu import Queue  # type: ignore[attr-defined]

from protocol.modelcard import load_card
from protocol.redis_conn import celery_redis_config
from protocol.settings import FleetSettings

__all__ = ["celery_config", "consumes_direct_queue", "restore_interval_s", "restore_lock_life_s", "routes_by_prefix"]


def celery_config(settings: FleetSettings) -> dict[str, Any]:
    """Celery settings derived from ``settings``.

    ``acks_late`` + ``task_reject_on_worker_lost`` + the Redis ``visibility_timeout`` give
    at-least-once delivery; ``worker_prefetch_multiplier=1`` with the threads pool makes the
    worker's concurrency the token bucket, so excess load waits in Redis. The broker and backend
    URLs, their TLS options and Sentinel's master name come from :func:`protocol.redis_conn.celery_redis_config`.
    Celery's per-task extras (events, the STARTED state, extended results) follow ``settings.celery``.
    """
    redis_conf = celery_redis_config(settings)
    worker_model = settings.worker.model
    queues = []
    other_lists_wait_s = 0.25
    if _configured(settings, worker_model):
        queues.append(Queue(settings.queue_for(worker_model)))  # type: ignore[no-untyped-call]
        if consumes_direct_queue(settings, worker_model):
            other_lists_wait_s = settings.model(worker_model).routing.direct_wait_ms / 1000
    return {
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        "result_expires": settings.result_ttl_s,
        "result_extended": settings.celery.result_extended,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "task_track_started": settings.celery.track_started,
        "worker_prefetch_multiplier": 1,
        "worker_concurrency": settings.worker.concurrency,
        "worker_pool": "threads",
        "worker_send_task_events": settings.celery.task_events,
        "task_send_sent_event": settings.celery.sent_events,
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout_s,
            # kombu scans for expired unacked messages every interval x throttle seconds (10 x 10 by
            # default); make a dead worker's requests come back within ~1/4 of the visibility timeout
            "unacked_restore_interval": restore_interval_s(settings.visibility_timeout_s),
            "unacked_restore_throttle": 1,
            # the scan runs under a Redis lock that lives unacked_mutex_expire seconds (kombu: 300); a worker
            # killed inside a scan, or cut off from Redis one way, stops every worker's restores until the
            # lock expires, so bound its life to one scan interval
            "unacked_mutex_expire": restore_lock_life_s(settings.visibility_timeout_s),
            # broker.atomic_take: how long the take waits on one list before it looks at the others, and the
            # list an idle worker waits on (the one its model's requests arrive on, shared with its other workers)
            "other_lists_wait_s": other_lists_wait_s,
            **({"shared_queue": queues[0].name} if queues else {}),
            **redis_conf.pop("broker_transport_options", {}),
        },
        "result_backend_transport_options": {
            "visibility_timeout": settings.visibility_timeout_s,
            **redis_conf.pop("result_backend_transport_options", {}),
        },
        **redis_conf,
        "task_queues": queues or None,
        "task_default_queue": queues[0].name if queues else "celery",
        "worker_cancel_long_running_tasks_on_connection_loss": False,
    }


def routes_by_prefix(settings: FleetSettings, model: str) -> bool:
    """True when ``model``'s workers consume a queue of their own for prefix-aware routing (routing on and a
    prefix cache to route to)."""
    served = settings.model(model)
    return served.routing.prefix_aware and served.batching.prefix_cache_bytes > 0


def consumes_direct_queue(settings: FleetSettings, model: str) -> bool:
    """True when a worker of ``model`` consumes a queue of its own (:mod:`workers.direct_queue`): routing is
    on (:func:`routes_by_prefix`) and the model can generate — its card says ``causal_lm``, or it has no
    card here yet (a store-served version is fetched later: the worker then decides as for any LM)."""
    if not routes_by_prefix(settings, model):
        return False
    path = settings.model(model).path
    if str(path).startswith("store:"):
        return True
    try:
        return load_card(path).kind == "causal_lm"
    except Exception:  # an unreadable card fails the worker's load later, with its own message
        return False


def restore_interval_s(visibility_timeout_s: int) -> int:
    """Seconds between kombu's scans for unacked messages past their visibility timeout (1..30)."""
    return max(1, min(30, visibility_timeout_s // 4))


def restore_lock_life_s(visibility_timeout_s: int) -> int:
    """Seconds kombu's restore-scan lock lives (1..30): one scan interval (:func:`restore_interval_s`).

    A scan restores at most 10 messages (milliseconds) and releases the lock; its life only matters when its
    holder never releases it, and then it is how long no worker of the fleet restores anything: a holder
    that dies inside a scan, or a worker cut off from Redis one way, whose ``SET unacked_mutex … NX`` reaches
    Redis while the reply never reaches it. Measured on 064b36b's tree (``test_partitions.py``'s one-way
    cut, ``visibility_timeout_s`` 3): with a 10 s life the other worker's scans were refused for 10 s and the
    cut-off worker's held requests were served 10.2 s after the cut; with this life, 3.4-3.5 s.
    Two scans that overlap after an early expiry (a scan slower than the lock's life, over a slow link)
    are safe: kombu restores each message in a transaction that watches the unacked hash, so a message
    comes back once, and its lock's release deletes only its own token.
    """
    return restore_interval_s(visibility_timeout_s)


def _configured(settings: FleetSettings, model: str) -> bool:
    try:
        settings.model_key(model)
    except Exception:
        return False
    return True

