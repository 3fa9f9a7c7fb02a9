"""Admission control: refuse work at the door instead of queueing it without bound.

Two checks, shared by :class:`producer.client.FleetClient` and the HTTP gateway:

- **Queue-depth cap** per model (``models.<name>.max_queue_depth``): the requests waiting in the model's
  Celery queues (Redis lists; a ``fleet.infer_bulk`` message counts as the requests it carries:
  :func:`broker.waiting_requests`, so bulk senders cannot pass the cap). At the cap a submission is refused at once
  with :class:`~protocol.errors.QueueFull`, whose ``retry_after_s`` is the time the queue needs, at
  its measured drain rate, to free a slot. The cap is soft: replicas check and then enqueue, so
  concurrent submitters may overshoot it by at most one request each.
- **Token bucket** per caller (``admission.rate_capacity`` requests, refilled at
  ``admission.rate_refill_per_s``), kept in a Redis hash and updated by one Lua script, so every
  gateway replica draws on the same bucket. Empty bucket → :class:`~protocol.errors.RateLimited`.

**Depth cache**: a producer reuses one queue-depth read for ``admission.queue_depth_cache_ms``
(default 250 ms), adding every request it admitted since (:class:`DepthCache`), so most submissions
cost no Redis command for admission; the read is renewed whenever the estimate would reach the cap,
so one producer alone never passes it. What *other* producers queued during the window is not seen:
across replicas the cap may be overshot by what they admit in that time (set 0 to read on every
submission).

The drain rate comes from per-second counters that workers increment as they take requests off
the queue (``fleet:drain:<model>:<second>``, see :mod:`workers.metrics`).

The arithmetic is pure (:func:`bucket_take`, :func:`drain_rate_per_s`, :func:`queue_retry_after_s`,
:func:`rate_retry_after_s`) and tested with an injected clock; the Lua script mirrors
:func:`bucket_take` line for line.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis

from broker import waiting_requests
from protocol.errors import InvalidRequest, QueueFull, RateLimited
from protocol.keys import DRAIN_KEY, RATE_KEY
from protocol.settings import FleetSettings

__all__ = [
    "TOKEN_BUCKET_LUA",
    "Admission",
    "BucketDecision",
    "DepthCache",
    "bucket_take",
    "drain_rate_per_s",
    "queue_retry_after_s",
    "rate_key_for",
    "rate_retry_after_s",
]


# -- pure arithmetic -----------------------------------------------------------------------------
@dataclass(frozen=True)
class BucketDecision:
    """Outcome of one :func:`bucket_take`: whether ``cost`` was granted and the bucket after it."""

    allowed: bool
    tokens: float
    """Tokens left after the decision (requests)."""
    ts_s: float
    """Time the bucket was last refilled to (s, same clock as ``now_s``)."""


def bucket_take(
    tokens: float | None,
    ts_s: float | None,
    now_s: float,
    *,
    capacity: float,
    refill_per_s: float,
    cost: float,
) -> BucketDecision:
    """Refill a token bucket up to ``now_s``, then take ``cost`` tokens if it holds them.

    Args:
        tokens, ts_s: the stored state; ``None`` = a new bucket, which starts full at ``now_s``.
        now_s: the current time (s). A clock that went backwards refills nothing.
        capacity: bucket size (requests); refill_per_s: refill rate (requests/s); cost: tokens asked.
    """
    if tokens is None or ts_s is None:
        tokens, ts_s = capacity, now_s
    if now_s > ts_s:
        tokens = min(capacity, tokens + (now_s - ts_s) * refill_per_s)
        ts_s = now_s
    if tokens >= cost:
        return BucketDecision(True, tokens - cost, ts_s)
    return BucketDecision(False, tokens, ts_s)


def rate_retry_after_s(tokens: float, cost: float, refill_per_s: float, max_s: int) -> int:
    """Whole seconds until a bucket holding ``tokens`` can grant ``cost`` (1 ≤ result ≤ ``max_s``)."""
    if refill_per_s <= 0:
        return max_s
    return _clamp(math.ceil((cost - tokens) / refill_per_s), max_s)


def drain_rate_per_s(counts: Mapping[int, int], now_s: float, window_s: float) -> float:
    """Requests per second a queue lost over the last ``window_s`` seconds.

    Args:
        counts: requests taken off the queue, by whole wall-clock second (unix time).
        now_s: the current wall-clock time (s).
        window_s: how far back to look (s).

    The rate is averaged from the oldest second with any activity (not the whole window), so a
    worker that started five seconds ago is not diluted by 25 idle seconds before it; the
    current, incomplete second counts as a full one.
    """
    now_sec = int(now_s)
    first = now_sec - max(1, int(window_s)) + 1
    live = {sec: n for sec, n in counts.items() if first <= sec <= now_sec and n > 0}
    if not live:
        return 0.0
    span_s = now_sec - min(live) + 1
    return sum(live.values()) / span_s


def queue_retry_after_s(depth: int, cap: int, count: int, rate_per_s: float, max_s: int) -> int:
    """Whole seconds until a queue of ``depth`` (capped at ``cap``) has room for ``count`` more.

    With no measured drain (``rate_per_s`` = 0: no worker is taking requests) it is ``max_s``.
    The result lies in ``[1, max_s]``.
    """
    excess = depth + count - cap
    if excess <= 0:
        return 1
    if rate_per_s <= 0:
        return max_s
    return _clamp(math.ceil(excess / rate_per_s), max_s)


class DepthCache:
    """Queue depths read from Redis, reused for ``ttl_s`` seconds plus what this process admitted since.

    Pure bookkeeping (the caller passes the monotonic time and does the Redis read); not thread-safe
    on its own (:class:`Admission` holds a lock around it). ``ttl_s`` = 0 keeps nothing.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[float, int]] = {}  # queue -> (read at, depth read + admitted since)

    def admits(self, queue: str, count: int, cap: int, now_s: float) -> bool:
        """True (and ``count`` is added to the estimate) when a fresh read leaves room for ``count``;
        False means: read the depth again (:meth:`store`) and decide on that."""
        entry = self._entries.get(queue)
        if entry is None or now_s - entry[0] >= self.ttl_s or entry[1] + count > cap:
            return False
        self._entries[queue] = (entry[0], entry[1] + count)
        return True

    def store(self, queue: str, depth: int, now_s: float) -> None:
        """Remember ``depth`` (requests), just read from Redis at ``now_s``."""
        if self.ttl_s > 0:
            self._entries[queue] = (now_s, depth)

    def add(self, queue: str, count: int) -> None:
        """``count`` more requests were admitted to ``queue`` on a fresh read."""
        entry = self._entries.get(queue)
        if entry is not None:
            self._entries[queue] = (entry[0], entry[1] + count)


def rate_key_for(api_key: str | None) -> str:
    """The bucket name for ``api_key``: a short SHA-256 digest, so keys never sit in Redis in clear."""
    if not api_key:
        return "anonymous"
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]


def _clamp(seconds: int, max_s: int) -> int:
    return max(1, min(max_s, seconds))


# -- Redis side ----------------------------------------------------------------------------------
TOKEN_BUCKET_LUA = """
-- KEYS[1]: bucket hash {tokens, ts}. ARGV: capacity, refill_per_s, cost, now_s ('' = Redis TIME).
-- Mirrors producer.admission.bucket_take. Returns {allowed (0/1), tokens left (string)}.
local capacity = tonumber(ARGV[1])
local refill = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local now
if ARGV[4] ~= nil and ARGV[4] ~= '' then
  now = tonumber(ARGV[4])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = capacity
  ts = now
end
if now > ts then
  tokens = math.min(capacity, tokens + (now - ts) * refill)
  ts = now
end
local allowed = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.9f', tokens), 'ts', string.format('%.6f', ts))
local ttl = 86400
if refill > 0 then
  ttl = math.ceil((capacity - tokens) / refill) + 1
end
redis.call('EXPIRE', KEYS[1], ttl)
return {allowed, string.format('%.9f', tokens)}
"""


class Admission:
    """The admission checks for one process, over one Redis connection pool.

    ``clock`` is the wall clock (s) used to read the per-second drain counters; the token bucket
    runs on Redis's own clock so that replicas with skewed clocks agree; ``monotonic`` (s) dates the
    queue-depth reads of the :class:`DepthCache`.
    """

    def __init__(
        self,
        client: redis.Redis[bytes],
        settings: FleetSettings,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = client
        self.settings = settings
        self.clock = clock
        self.monotonic = monotonic
        self._bucket = client.register_script(TOKEN_BUCKET_LUA)
        self._depths = DepthCache(settings.admission.queue_depth_cache_ms / 1000)
        self._depths_lock = threading.Lock()

    def admit(self, model: str, *, count: int = 1, rate_key: str | None = None, unqueued: int = 0) -> None:
        """Admit ``count`` requests for ``model`` from caller ``rate_key`` (None = no rate limit).

        The queue is checked first, so a refused request never spends rate tokens. ``unqueued``: see
        :meth:`check_queue`.

        Raises:
            UnknownModel: ``model`` is not configured.
            QueueFull: the queue holds ``max_queue_depth`` requests (``retry_after_s`` set).
            RateLimited: the caller's bucket holds fewer than ``count`` tokens (``retry_after_s`` set).
            InvalidRequest: ``count`` exceeds the bucket's whole capacity (it could never pass).
        """
        self.check_queue(model, count, unqueued=unqueued)
        if rate_key is not None:
            self.take_rate(rate_key, count)

    def check_queue(self, model: str, count: int = 1, *, unqueued: int = 0) -> None:
        """Refuse when ``count`` more requests would push ``model``'s queues past its cap.

        The cap is the model's: its stable queue and its canary queue together (every worker of the
        model takes from both), so a canary split never lets more than ``max_queue_depth`` wait.
        ``unqueued``: requests this process admitted for ``model`` but has not queued yet (a group
        being built: :func:`producer.submit_groups.send_group`); a fresh read of the queues cannot see
        them, so they are added to it.

        Raises:
            QueueFull: with ``retry_after_s`` from the measured drain rate.
        """
        key = self.settings.model_key(model)
        cap = self.settings.models[key].max_queue_depth
        queue = self.settings.queue_for(key)
        with self._depths_lock:
            if self._depths.admits(queue, count, cap, self.monotonic()):
                return
        depth = waiting_requests(self.redis, queue, self.settings.canary_queue_for(key)) + unqueued
        if depth + count <= cap:
            with self._depths_lock:
                self._depths.store(queue, depth + count, self.monotonic())
            return
        rate = self.drain_rate_per_s(key)
        retry = queue_retry_after_s(depth, cap, count, rate, self.settings.admission.max_retry_after_s)
        raise QueueFull(
            f"queues {queue} and its .canary of model {key!r} hold {depth} requests; the limit is "
            f"models.{key}.max_queue_depth={cap} (draining at {rate:.2f} req/s; retry after {retry} s)",
            "max_queue_depth",
            cap,
            float(retry),
        )

    def take_rate(self, rate_key: str, cost: int = 1) -> None:
        """Take ``cost`` tokens from caller ``rate_key``'s bucket (no-op when rate_capacity is 0).

        Raises:
            RateLimited: too few tokens; ``retry_after_s`` says when there will be enough.
            InvalidRequest: ``cost`` exceeds ``admission.rate_capacity``.
        """
        adm = self.settings.admission
        if adm.rate_capacity <= 0:
            return
        if cost > adm.rate_capacity:
            raise InvalidRequest(
                f"{cost} requests at once exceed the limit admission.rate_capacity={adm.rate_capacity:g}",
                "requests",
                adm.rate_capacity,
            )
        allowed, tokens = self.take_tokens(rate_key, cost)
        if allowed:
            return
        retry = rate_retry_after_s(tokens, cost, adm.rate_refill_per_s, adm.max_retry_after_s)
        raise RateLimited(
            f"rate limit exceeded: the limit is admission.rate_capacity={adm.rate_capacity:g} requests "
            f"refilled at admission.rate_refill_per_s={adm.rate_refill_per_s:g}/s (retry after {retry} s)",
            "rate_capacity",
            adm.rate_capacity,
            float(retry),
        )

    def take_tokens(self, rate_key: str, cost: float, now_s: float | None = None) -> tuple[bool, float]:
        """Run the bucket script once: ``(allowed, tokens left)``; ``now_s`` None = Redis's clock (s)."""
        adm = self.settings.admission
        allowed, tokens = self._bucket(
            keys=[RATE_KEY.format(key=rate_key)],
            args=[adm.rate_capacity, adm.rate_refill_per_s, cost, "" if now_s is None else repr(now_s)],
        )
        return bool(int(allowed)), float(tokens)

    def drain_rate_per_s(self, model: str) -> float:
        """Requests per second workers took off ``model``'s queue over ``admission.drain_window_s``."""
        window_s = self.settings.admission.drain_window_s
        now_s = self.clock()
        seconds = list(range(int(now_s) - max(1, int(window_s)) + 1, int(now_s) + 1))
        raw = self.redis.mget([DRAIN_KEY.format(model=model, second=s) for s in seconds])
        counts = {s: int(v) for s, v in zip(seconds, raw, strict=True) if v is not None}
        return drain_rate_per_s(counts, now_s, window_s)
