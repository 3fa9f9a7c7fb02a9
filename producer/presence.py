"""Whether a model has a live worker: the live set each worker's heartbeat writes (``fleet:live:<model>``).

A request for a model no worker serves is still accepted (a fleet scaled to zero wakes up on its queue),
but the caller is told: the submit answer, ``fleet submit --wait``, the status by ID and the OpenAI
routes' wait say :func:`no_worker_message`. Each heartbeat scores its worker in the model's sorted set
with the time its heartbeat expires (:mod:`workers.health`), and a stopping worker removes itself, so
"no live worker" is exact for a stopped worker and at most three heartbeat periods stale for a dead one.

One ``ZCOUNT`` answers it, whatever the size of the keyspace (reading every heartbeat would be a ``SCAN``
of it); :class:`WorkerPresence` still keeps each answer for ``cache_s``, so a busy gateway asks Redis
once a second per model, not once per request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio

from protocol.keys import LIVE_WORKERS_KEY, REQUEST_KEY

__all__ = ["CACHE_S", "AsyncWorkerPresence", "WorkerPresence", "has_live_worker", "has_live_worker_async",
           "marker_key", "no_worker_message", "request_model"]

CACHE_S = 1.0
"""How long an answer read from Redis is reused (s)."""


def no_worker_message(model: str, queue: str) -> str:
    """The one line every face says when ``model`` has no live worker."""
    return (f"no live worker serves model {model!r}: the request waits in {queue} until one starts "
            f"(start one: `fleet worker --model {model}`; `fleet status` lists the workers)")


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


def has_live_worker(client: redis.Redis[bytes], model: str) -> bool:
    """True when a worker of ``model`` has an unexpired heartbeat (ready or still warming up)."""
    return int(client.zcount(LIVE_WORKERS_KEY.format(model=model), time.time(), "+inf")) > 0


async def has_live_worker_async(client: redis.asyncio.Redis[bytes], model: str) -> bool:
    """:func:`has_live_worker` on ``redis.asyncio`` (the gateway's event loop)."""
    return int(await client.zcount(LIVE_WORKERS_KEY.format(model=model), time.time(), "+inf")) > 0


class AsyncWorkerPresence:
    """:func:`has_live_worker_async` per model, read at most once per ``cache_s`` however many coroutines
    ask (``clock``: monotonic seconds)."""

    def __init__(self, client: redis.asyncio.Redis[bytes], *, cache_s: float = CACHE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.cache_s = cache_s
        self.clock = clock
        self._answers: dict[str, tuple[float, bool]] = {}
        self._lock = asyncio.Lock()

    async def has_worker(self, model: str) -> bool:
        """True when a worker of ``model`` was live at the last read (at most ``cache_s`` old)."""
        async with self._lock:  # one reader refreshes; the others wait for its answer
            now = self.clock()
            cached = self._answers.get(model)
            if cached is None or now - cached[0] >= self.cache_s:
                cached = (now, await has_live_worker_async(self.client, model))
                self._answers[model] = cached
        return cached[1]


class WorkerPresence:
    """:func:`has_live_worker` per model, read at most once per ``cache_s``; thread-safe (``clock``:
    monotonic seconds)."""

    def __init__(self, client: redis.Redis[bytes], *, cache_s: float = CACHE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.cache_s = cache_s
        self.clock = clock
        self._answers: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def has_worker(self, model: str) -> bool:
        """True when a worker of ``model`` was live at the last read (at most ``cache_s`` old)."""
        with self._lock:  # one thread refreshes; the others wait for its answer
            now = self.clock()
            cached = self._answers.get(model)
            if cached is None or now - cached[0] >= self.cache_s:
                cached = (now, has_live_worker(self.client, model))
                self._answers[model] = cached
        return cached[1]
