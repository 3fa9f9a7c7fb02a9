"""Measurement only: the producer as it was before issue 11's dispatch changes (commit 4e00f31).

The same ``FleetClient`` with its old habits back, so that the dispatch phase can run the old and the
new path side by side in one run (the machine is shared: runs an hour apart are not comparable); its
worker runs through :mod:`bench.legacy_worker`, which puts the worker's old habits back:

* Celery's ``send_task`` instead of :mod:`producer.task_writer`, through kombu's own Redis channel
  (a new ``redis.Redis`` per command; :mod:`protocol.kombu_channel` is bypassed for this app only);
* Celery's ``AsyncResult.get`` to wait for a result instead of :mod:`producer.result_waiter`;
* a marker ``GET`` before the ``SET NX`` of every submission;
* Celery's send-time result subscription (``SUBSCRIBE`` on send, ``UNSUBSCRIBE`` when the dropped
  ``AsyncResult`` goes);
* the queue depth read on every submission, a STARTED state for every request and extended results: the
  variant's config sets ``admission.queue_depth_cache_ms: 0``, ``celery.track_started: true`` and
  ``celery.result_extended: true`` (see :attr:`bench.procs.FleetConfig.legacy`).
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeout
from kombu.transport import redis as kombu_redis

from producer.client import FleetClient
from protocol.errors import FleetError, ResultTimeout
from protocol.keys import REQUEST_KEY
from protocol.messages import InferenceRequest, InferenceResult
from protocol.settings import FleetSettings

__all__ = ["LEGACY_SETTINGS", "LegacyFleetClient"]

LEGACY_SETTINGS: dict[str, dict[str, Any]] = {
    "admission": {"queue_depth_cache_ms": 0},
    "celery": {"result_extended": True, "track_started": True},
}
"""Settings sections of the old path (merged into the variant's config)."""


class StockChannelTransport(kombu_redis.Transport):
    """kombu's Redis transport with kombu's own channel, whatever this process installed."""

    Channel = kombu_redis.Channel


class LegacyFleetClient(FleetClient):
    """``FleetClient`` with the old producer's Redis round trips (see the module docstring)."""

    def __init__(self, settings: FleetSettings) -> None:
        super().__init__(settings)
        self.app.conf.broker_transport = StockChannelTransport
        self.writer._usable = False  # Celery's send_task
        backend = self.app.backend
        backend.on_task_call = type(backend).on_task_call.__get__(backend)

    def result(self, request_id: str, *, wait: bool = False, timeout_s: float | None = None) -> InferenceResult | None:
        """The old wait: Celery's ``AsyncResult.get`` (not waiting: as served)."""
        if not wait:
            return super().result(request_id, timeout_s=timeout_s)
        res = self._async(request_id)
        try:
            res.get(timeout=timeout_s, propagate=False, interval=0.05)
        except CeleryTimeout as exc:
            raise ResultTimeout(f"no result for {request_id} within {timeout_s} s", "timeout_s", timeout_s) from exc
        finally:
            self.app.backend.remove_pending_result(res)
        outcome = self.outcome_of(request_id, {"status": res.state, "result": res.result})
        if outcome is None:
            raise FleetError(f"request {request_id} ended in state {res.state}", "request_id", None)
        return self._raise_or_return(outcome)

    def send(self, request: InferenceRequest, **options: Any) -> str:
        """The old look-up first, then the real send."""
        self.redis.get(REQUEST_KEY.format(id=request.request_id))
        return super().send(request, **options)
