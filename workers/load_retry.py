"""Which failed loads the reconciler tries again, and when: pure, no Redis, no store, no clock.

A load fails for one of two reasons, and they call for opposite answers:

- a **verdict** about the version (ChecksumMismatch, VersionNotFound, IncompatibleVersion, a graph that does
  not fit, a card or file ORT refuses): trying again gives the same answer, so the reconciler refuses the
  version until the desired state changes (its ``generation`` grows);
- a **transient** failure of the store (:func:`transient`): it was unreachable, timed out, reset the
  connection, answered a 5xx or a throttle, or a download stalled. The version may load as soon as the store
  answers again, so the periodic re-read tries it again (:class:`LoadRetries`): first after
  ``worker.reconcile_interval_s``, then after twice the wait before, up to :data:`MAX_RETRY_WAIT_S`; a load
  that succeeds ends the outage, and a later failure starts a new one at the first wait. A state change (a pin,
  a canary) tries at once, as it does for a verdict, without starting the outage again.

Times are monotonic seconds passed in; tested by tables in ``tests/unit/test_load_retry.py``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError
from s3transfer.exceptions import RetriesExceededError

from store.errors import CacheUnwritable, ObjectExists, ObjectMissing, StoreError, VersionExists, VersionNotFound
from workers.reconcile_plan import Retry

__all__ = ["MAX_RETRY_WAIT_S", "LoadRetries", "StoreOutage", "transient"]

MAX_RETRY_WAIT_S = 180.0
"""Longest wait between two tries of a version the store could not deliver (s): a store back after a long
outage is noticed within 3 minutes."""

_VERDICTS = (ObjectExists, ObjectMissing, VersionExists, VersionNotFound, CacheUnwritable)
"""StoreErrors that are answers about the key or the local cache, not the store failing to answer."""

_TRANSIENT_CODES = frozenset({
    "InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestThrottled", "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
    "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete",
    "500", "502", "503", "504",
})
"""S3 error codes of a store that is failing or overloaded (botocore's standard retry mode treats them so)."""

_TRANSIENT_CAUSES = (BotoConnectionError, HTTPClientError, IncompleteReadError, RetriesExceededError,
                     ConnectionError, TimeoutError)
"""What :mod:`store.s3` chains to the StoreError when the store did not answer: no connection (refused,
timed out), a read timeout or a connection reset (botocore's HTTPClientError), a body cut short, s3transfer
giving up on a stalled body, or the socket's own errors."""


def transient(exc: BaseException) -> bool:
    """Whether a load that raised ``exc`` may succeed if tried again unchanged: the store did not answer.

    True for the StoreError that :mod:`store.s3` raises from a connection, timeout or reset (its cause is a
    botocore connection/HTTP error), from an S3 5xx or throttle (a ClientError whose code or HTTP status says
    so), or from the download stall deadline (no cause; its ``limit`` is ``store.fetch_stall_timeout_s``, a
    number of seconds). False for everything else: a verdict about the version (ChecksumMismatch,
    VersionNotFound, IncompatibleVersion, ModelLoadError, ...), a refused request (403, NoSuchBucket, no
    credentials), a local cache that cannot hold it.
    """
    if not isinstance(exc, StoreError) or isinstance(exc, _VERDICTS):
        return False
    cause = exc.__cause__
    if cause is None:  # the stall deadline: the cause-less StoreError whose limit is seconds (not max_bytes)
        limit = exc.args[2] if len(exc.args) == 3 else None
        return isinstance(limit, int | float) and not isinstance(limit, bool) and exc.args[1] != "max_bytes"
    if isinstance(cause, ClientError):
        error = cause.response.get("Error", {})
        status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return str(error.get("Code", "")) in _TRANSIENT_CODES or (isinstance(status, int) and status >= 500)
    return isinstance(cause, _TRANSIENT_CAUSES)


@dataclass(frozen=True)
class StoreOutage:
    """One version's run of transient failures: since when (s), how many tries failed, the latest wait (s)."""

    since_s: float
    failures: int
    wait_s: float


class LoadRetries:
    """The versions whose latest load failed transiently, and when each is tried again (not thread-safe: the
    reconciler calls it under its lock).

    Args:
        first_wait_s: the wait after an outage's first failure (``worker.reconcile_interval_s``); it doubles
            after each further failure, up to ``max_wait_s``.
        max_wait_s: the longest wait (default :data:`MAX_RETRY_WAIT_S`).
    """

    def __init__(self, first_wait_s: float, max_wait_s: float = MAX_RETRY_WAIT_S) -> None:
        self.first_wait_s = first_wait_s
        self.max_wait_s = max(max_wait_s, first_wait_s)
        self._outages: dict[str, StoreOutage] = {}
        self._retries: dict[str, Retry] = {}

    @property
    def pending(self) -> Mapping[str, Retry]:
        """Version -> when it is tried again (:func:`workers.reconcile_plan.plan` skips it until then)."""
        return self._retries

    def failed(self, version: str, generation: int, now_s: float) -> StoreOutage:
        """A load of ``version`` under state ``generation`` failed transiently at ``now_s``: the outage so far
        (``failures`` 1: its first, the one to log)."""
        before = self._outages.get(version)
        if before is None:
            outage = StoreOutage(since_s=now_s, failures=1, wait_s=self.first_wait_s)
        else:
            outage = StoreOutage(before.since_s, before.failures + 1, min(self.max_wait_s, before.wait_s * 2))
        self._outages[version] = outage
        self._retries[version] = Retry(generation=generation, at_s=now_s + outage.wait_s)
        return outage

    def ended(self, version: str) -> StoreOutage | None:
        """``version`` loaded, or got a verdict: its outage (None: it had none) ends; the next failure starts
        a new one at the first wait."""
        self._retries.pop(version, None)
        return self._outages.pop(version, None)

    def retain(self, versions: Collection[str | None]) -> None:
        """Forget the outages of versions the state no longer names (so that a later outage of one of them is
        logged as a new one)."""
        for version in [v for v in self._outages if v not in versions]:
            self.ended(version)
