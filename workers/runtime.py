"""This process's one worker runtime: :func:`start_runtime`, :func:`current_runtime`, :func:`stop_runtime`.

The runtime itself (settings, loaded versions, scheduler and heartbeat) is
:class:`workers.worker_runtime.WorkerRuntime`, built once at ``worker_init`` (before the consumer starts),
so a worker never takes a request before its model is loaded and warmed up. Task threads reach it
through :func:`current_runtime`. :class:`WorkerRuntime`, :func:`kv_cache_doc` and
:data:`HOLD_DEPTH_TIMEOUT_S` (s) are importable from here too.
"""

from __future__ import annotations

import threading

import redis

from protocol.errors import ConfigError, ModelLoadError
from protocol.redis_conn import sync_client
from protocol.settings import FleetSettings
from workers.namesakes import live_namesake, namesake_message
from workers.runtime_counts import HOLD_DEPTH_TIMEOUT_S
from workers.worker_runtime import WorkerRuntime, kv_cache_doc

__all__ = [
    "HOLD_DEPTH_TIMEOUT_S",
    "WorkerRuntime",
    "current_runtime",
    "kv_cache_doc",
    "start_runtime",
    "stop_runtime",
]

_runtime: WorkerRuntime | None = None
_lock = threading.Lock()


def _refuse_a_running_namesake(settings: FleetSettings, hostname: str) -> None:
    """Raise ConfigError when a live worker of another process already runs under ``hostname``
    (:mod:`workers.namesakes`); a Redis that does not answer yet is not a reason to refuse."""
    client = sync_client(settings, socket_timeout=5)
    try:
        namesake = live_namesake(client, hostname)
    except redis.RedisError:
        return
    finally:
        client.close()
    if namesake is not None:
        model = settings.model_key(settings.worker.model) if settings.worker.model else "<model>"
        raise ConfigError(namesake_message(hostname, namesake, model), "hostname", "one live worker per name")


def start_runtime(settings: FleetSettings, *, hostname: str, concurrency: int, pool: str) -> WorkerRuntime:
    """Build and start this process's runtime (once).

    Raises:
        ConfigError: wrong pool, too few tokens for the batch size, unknown model, a live worker of another
            process under ``hostname``.
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
    _refuse_a_running_namesake(settings, hostname)
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
