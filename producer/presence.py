"""Whether a model has a live worker: the heartbeats ``/readyz`` reads (``fleet:worker:<hostname>``).

A request for a model no worker serves is still accepted (a fleet scaled to zero wakes up on its queue),
but the caller is told: the submit answer, ``fleet submit --wait``, the status by ID and the OpenAI
routes' wait say :func:`no_worker_message`. A heartbeat expires three periods after its worker stops
(:mod:`workers.health`), so "no live worker" is at most ~6 s stale with the default ``heartbeat_s``.

Reading every heartbeat is a ``SCAN`` over the keyspace, so :class:`WorkerPresence` keeps the answer for
``cache_s`` (one read per second per process at most, not one per request).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis
import redis.asyncio

from protocol.keys import REQUEST_KEY, WORKER_KEY_PREFIX

__all__ = ["CACHE_S", "AsyncWorkerPresence", "WorkerPresence", "live_models", "live_models_async", "marker_key",
           "no_worker_message", "request_model"]

CACHE_S = 1.0
"""How long a read of the heartbeats is reused (s)."""


def no_worker_message(model: str, queue: str) -> str:
    """The one line every face says when ``model`` has no live worker."""
    return (f"no live worker serves model {model!r}: the request waits in {queue} until one starts "
            f"(start one: `fleet worker --model {model}`; `fleet status` lists the workers)")


def _models_of(raws: Iterable[bytes | None]) -> set[str]:
    models = set()
    for raw in raws:
        try:
            doc: Any = json.loads(raw) if raw else None
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("model"):
            models.add(str(doc["model"]))
    return models


def request_model(raw_marker: bytes | str | None) -> str | None:
    """The model named by a request's submit marker (``fleet:req:<id>``); None when unknown or unreadable."""
    try:
        doc: Any = json.loads(raw_marker) if raw_marker else None
    except ValueError:
        return None
    return str(doc["model"]) if isinstance(doc, dict) and doc.get("model") else None


def marker_key(request_id: str) -> str:
    """Where the submit marker of ``request_id`` lives."""
    return REQUEST_KEY.format(id=request_id)


def live_models(client: redis.Redis[bytes]) -> set[str]:
    """Models with at least one unexpired worker heartbeat (ready or still warming up)."""
    keys = list(client.scan_iter(match=WORKER_KEY_PREFIX + "*", count=500))
    return _models_of(client.mget(keys)) if keys else set()


async def live_models_async(client: redis.asyncio.Redis[bytes]) -> set[str]:
    """:func:`live_models` on ``redis.asyncio`` (the gateway's event loop)."""
    keys = [key async for key in client.scan_iter(match=WORKER_KEY_PREFIX + "*", count=500)]
    return _models_of(await client.mget(keys)) if keys else set()


class AsyncWorkerPresence:
    """:func:`live_models_async`, read at most once per ``cache_s`` however many coroutines ask (the
    gateway's waits share one read: one SCAN a second, not one per waiting request)."""

    def __init__(self, client: redis.asyncio.Redis[bytes], *, cache_s: float = CACHE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.cache_s = cache_s
        self.clock = clock
        self._read_at: float | None = None
        self._models: set[str] = set()
        self._lock = asyncio.Lock()

    async def has_worker(self, model: str) -> bool:
        """True when a heartbeat of ``model`` was live at the last read (at most ``cache_s`` old)."""
        async with self._lock:  # one reader refreshes; the others wait for its answer
            now = self.clock()
            if self._read_at is None or now - self._read_at >= self.cache_s:
                self._models, self._read_at = await live_models_async(self.client), now
        return model in self._models


class WorkerPresence:
    """:func:`live_models`, read at most once per ``cache_s`` (``clock``: monotonic seconds)."""

    def __init__(self, client: redis.Redis[bytes], *, cache_s: float = CACHE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.cache_s = cache_s
        self.clock = clock
        self._read_at: float | None = None
        self._models: set[str] = set()

    def has_worker(self, model: str) -> bool:
        """True when a heartbeat of ``model`` was live at the last read (at most ``cache_s`` old)."""
        now = self.clock()
        if self._read_at is None or now - self._read_at >= self.cache_s:
            self._models, self._read_at = live_models(self.client), now
        return model in self._models
