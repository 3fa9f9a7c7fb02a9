"""Measurement only: the producer as it was before issue 11's dispatch changes (commit 4e00f31).

The same ``FleetClient`` with its three old habits back, so that the dispatch phase can run the old and the
new path side by side in one run (the machine is shared: runs an hour apart are not comparable):

* a marker ``GET`` before the ``SET NX`` of every submission;
* Celery's send-time result subscription (``SUBSCRIBE`` on send, ``UNSUBSCRIBE`` when the dropped
  ``AsyncResult`` goes);
* the queue depth read on every submission, a STARTED state for every request and extended results: the
  variant's config sets ``admission.queue_depth_cache_ms: 0``, ``celery.track_started: true`` and
  ``celery.result_extended: true`` (see :attr:`bench.procs.FleetConfig.legacy`).
"""

from __future__ import annotations

from typing import Any

from producer.client import FleetClient
from protocol.keys import REQUEST_KEY
from protocol.messages import InferenceRequest
from protocol.settings import FleetSettings

__all__ = ["LEGACY_SETTINGS", "LegacyFleetClient"]

LEGACY_SETTINGS: dict[str, dict[str, Any]] = {
    "admission": {"queue_depth_cache_ms": 0},
    "celery": {"result_extended": True, "track_started": True},
}
"""Settings sections of the old path (merged into the variant's config)."""


class LegacyFleetClient(FleetClient):
    """``FleetClient`` with the old producer's Redis round trips (see the module docstring)."""

    def __init__(self, settings: FleetSettings) -> None:
        super().__init__(settings)
        backend = self.app.backend
        backend.on_task_call = type(backend).on_task_call.__get__(backend)

    def send(self, request: InferenceRequest, **options: Any) -> str:
        """The old look-up first, then the real send."""
        self.redis.get(REQUEST_KEY.format(id=request.request_id))
        return super().send(request, **options)
