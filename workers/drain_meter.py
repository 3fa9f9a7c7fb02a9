"""The queue drain meter: requests this worker took off its queue, per wall-clock second, in Redis.

Admission control estimates Retry-After from the fleet's drain rate over
``admission.drain_window_s`` (30 s by default), summed from ``fleet:drain:<model>:<second>`` keys
(:mod:`producer.admission`). Writing those keys per request cost 2 Redis commands per request
(``INCRBY`` + ``EXPIRE``), 8 % of the ``fleet.infer`` path's commands. :class:`DrainMeter` counts in
memory and writes each second's count once per :data:`FLUSH_INTERVAL_S` from a daemon thread (one
pipeline per flush, whatever the load), and at shutdown: the estimate lags by at most that interval,
against a window of tens of seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import redis

from protocol.keys import DRAIN_KEY

__all__ = ["FLUSH_INTERVAL_S", "DrainMeter"]

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.5
"""Seconds between two writes of the counts to Redis (the meter's lag)."""


class DrainMeter:
    """Per-second dequeue counts of one model, kept in memory and flushed to Redis in the background.

    ``client`` returns the Redis client to write with (the worker runtime's, which follows a Sentinel
    failover); ``window_s`` is the admission window the keys must outlive.
    """

    def __init__(self, model: str, client: Callable[[], redis.Redis[bytes]], window_s: float,
                 flush_interval_s: float = FLUSH_INTERVAL_S) -> None:  # fmt: skip
        self.model = model
        self._client = client
        self._ttl_s = int(window_s) + 5
        self._interval_s = flush_interval_s
        self._pending: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="fleet-drain-meter", daemon=True)
        self._thread.start()

    def add(self, count: int = 1, now_unix_s: float | None = None) -> None:
        """``count`` requests left the queue now (no Redis command here)."""
        if count <= 0:
            return
        second = int(time.time() if now_unix_s is None else now_unix_s)
        with self._lock:
            self._pending[second] += count

    def flush(self) -> bool:
        """Write the pending counts (one pipeline); False, keeping them for the next try, when Redis fails."""
        with self._lock:
            pending, self._pending = self._pending, Counter()
        if not pending:
            return True
        try:
            with self._client().pipeline(transaction=False) as pipe:
                for second, count in sorted(pending.items()):
                    key = DRAIN_KEY.format(model=self.model, second=second)
                    pipe.incrby(key, count)
                    pipe.expire(key, self._ttl_s)
                pipe.execute()
        except redis.RedisError as exc:  # metrics never fail a request; counts wait for the next flush
            log.warning("drain meter update failed: %s", exc)
            with self._lock:
                self._pending.update(pending)
            return False
        return True

    def close(self) -> None:
        """Stop the flusher and write what is pending (at worker shutdown)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._interval_s)
            if not self._stopped:
                self.flush()
