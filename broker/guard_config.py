"""The poison guard's configuration: the worker's app, hostname and limits, bound once per worker process.

:class:`broker.poison.GuardedChannel` reads it at each item it takes (:func:`current`): task names and the
result backend for its checks and FAILURE results, ``worker.max_deliveries`` and the delivery count's TTL
(s), and the store of items popped while Redis refuses writes. Bound by :func:`configure` at once, or at
``celeryd_after_setup`` (:func:`configure_at_worker_setup`, from ``worker_init``); unbound, the guard runs
without task names, delivery counts or FAILURE results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import Celery, signals

from broker.deliveries import count_ttl_s
from broker.redis_refusals import ParkedItems
from protocol.redis_conn import sync_client
from protocol.settings import FleetSettings

__all__ = ["GuardConfig", "configure", "configure_at_worker_setup", "current"]

log = logging.getLogger("fleet.poison")


@dataclass(frozen=True)
class GuardConfig:
    """What the guard needs from the worker: its app (task names, result backend) and limits."""

    app: Celery
    hostname: str
    max_deliveries: int
    count_ttl_s: int
    parked: ParkedItems | None = None
    """Messages popped just before Redis began refusing writes, held until they can go back."""


_config: GuardConfig | None = None


def current() -> GuardConfig | None:
    """The configuration bound in this process; None before :func:`configure` (or when it never ran)."""
    return _config


def configure(app: Celery, settings: FleetSettings, hostname: str) -> GuardConfig:
    """Bind the guard to this worker's app and settings (task names, result backend, max_deliveries)."""
    global _config
    _config = GuardConfig(
        app=app,
        hostname=hostname,
        max_deliveries=settings.worker.max_deliveries,
        count_ttl_s=count_ttl_s(
            visibility_timeout_s=settings.visibility_timeout_s,
            result_ttl_s=settings.result_ttl_s,
            max_deliveries=settings.worker.max_deliveries,
        ),
        parked=ParkedItems(lambda: sync_client(settings, socket_timeout=5)),
    )
    return _config


_worker_settings: Callable[[], FleetSettings | None] | None = None
"""Where the guard reads the worker's settings at ``celeryd_after_setup`` (given to
:func:`configure_at_worker_setup`)."""


def _configure_from_worker(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """``celeryd_after_setup``: the worker's app and hostname are known, its settings are built."""
    settings = _worker_settings() if _worker_settings is not None else None
    if instance is None or settings is None:
        log.warning("poison guard: no worker runtime; task names, delivery counts and FAILURE results are off")
        return
    configure(instance.app, settings, str(instance.hostname))


def configure_at_worker_setup(worker_settings: Callable[[], FleetSettings | None] | None) -> None:
    """Configure the guard at ``celeryd_after_setup``, from the worker being set up and the settings
    ``worker_settings()`` returns then (None, or no ``worker_settings``: unconfigured, with a warning)."""
    global _worker_settings
    _worker_settings = worker_settings
    signals.celeryd_after_setup.connect(_configure_from_worker, weak=False)
