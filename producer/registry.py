"""The fleet as Redis sees it: worker heartbeats, queues, readiness.

Read by ``GET /v1/models``, ``/readyz``, ``fleet status`` and ``fleet probe``. Workers publish
``fleet:worker:<hostname>`` (see :mod:`workers.health`; it expires after three heartbeat
periods, so a dead worker drops out by itself). Queues are kombu's Redis lists: producers LPUSH,
workers RPOP, so the oldest waiting message sits at the tail (index -1) of the queue's list or of one of
kombu's priority siblings; its body carries the request's ``submitted_at_unix_s`` (a bulk message: each of its
requests'). ``direct_depth`` counts what waits in the model's workers' own queues
(prefix-aware routing, :mod:`workers.direct_queue`): the live workers' and those registered as consuming one.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from broker import queue_lists, waiting_counts
from producer.admission import Admission
from protocol.errors import ModelLoadError
from protocol.keys import CARD_KEY, DIRECT_QUEUES_KEY, WORKER_KEY_PREFIX
from protocol.modelcard import ModelCard, card_path_for, load_card
from protocol.redis_conn import describe_redis_error
from protocol.settings import FleetSettings

__all__ = [
    "FleetState",
    "ModelState",
    "list_workers",
    "message_submitted_at",
    "oldest_waiting_age_s",
    "read_fleet_state",
    "readiness_problems",
]


@dataclass(frozen=True)
class ModelState:
    """One configured model: its queue and the workers serving it."""

    name: str
    queue: str
    depth: int
    """Requests waiting in the model's queue (a bulk message counts the requests it carries: broker.waiting_counts)."""
    max_queue_depth: int
    oldest_waiting_s: float | None
    """Age of the oldest queued request (s); None when the queue is empty or the age is unknown."""
    drain_rate_per_s: float
    workers: list[dict[str, Any]]
    configured_version: str | None
    """``models.<name>.version``, else the version in the model card (None when neither is known)."""
    direct_depth: int = 0
    """Requests waiting in the own queues of this model's workers (not in ``depth``)."""

    @property
    def ready_workers(self) -> int:
        """Workers whose heartbeat says ready."""
        return sum(1 for w in self.workers if w.get("ready"))

    @property
    def in_flight(self) -> int:
        """Requests held by this model's workers (dequeued, result not yet written)."""
        return sum(int(w.get("in_flight") or 0) for w in self.workers)

    @property
    def versions(self) -> list[str]:
        """Versions the ready workers serve."""
        return sorted({str(w["version"]) for w in self.workers if w.get("ready") and w.get("version")})


@dataclass(frozen=True)
class FleetState:
    """A snapshot of the whole fleet; ``redis_error`` is set (and the rest empty) when Redis is down."""

    redis_error: str | None
    models: list[ModelState] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)


def list_workers(client: redis.Redis[bytes]) -> list[dict[str, Any]]:
    """Every live worker's latest heartbeat document, sorted by hostname."""
    keys = sorted(client.scan_iter(match=WORKER_KEY_PREFIX + "*", count=500))
    docs = []
    for raw in client.mget(keys) if keys else []:
        if raw:
            try:
                doc = json.loads(raw)
            except ValueError:
                continue
            if isinstance(doc, dict):
                docs.append(doc)
    return sorted(docs, key=lambda d: str(d.get("hostname")))


def _submitted_at(request: Any) -> float | None:
    value = request.get("submitted_at_unix_s") if isinstance(request, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def message_submitted_at(raw: bytes | str) -> float | None:
    """``submitted_at_unix_s`` of the request inside one kombu message: a ``fleet.infer_bulk`` message's is
    its earliest request's (None if absent or unreadable)."""
    try:
        envelope = json.loads(raw)
        body: Any = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        payload = json.loads(body)
        args = payload[0] if isinstance(payload, list) else payload.get("args")
        first = args[0]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    items = first.get("requests") if isinstance(first, dict) else None
    times = [t for t in map(_submitted_at, items if isinstance(items, list) else [first]) if t is not None]
    return min(times) if times else None


def oldest_waiting_age_s(client: redis.Redis[bytes], queue: str, now_s: float) -> float | None:
    """Age (s) of the oldest request waiting in ``queue``, its own list's and kombu's priority siblings' tails
    (:func:`broker.queue_lists`) read in one round trip; None if empty or not a fleet request."""
    with client.pipeline(transaction=False) as pipe:
        for listed in queue_lists(queue):
            pipe.lindex(listed, -1)
        tails = pipe.execute()
    times = [t for t in (message_submitted_at(raw) for raw in tails if raw is not None) if t is not None]
    return max(0.0, now_s - min(times)) if times else None


def read_fleet_state(settings: FleetSettings, client: redis.Redis[bytes], now_s: float | None = None) -> FleetState:
    """Heartbeats and queue figures for every configured model (never raises on a Redis outage)."""
    now_s = time.time() if now_s is None else now_s
    try:
        workers = list_workers(client)
        admission = Admission(client, settings, clock=lambda: now_s)
        waiting = waiting_counts(client, [settings.queue_for(name) for name in settings.models])  # one round trip
        models = []
        for name, model in settings.models.items():
            queue = settings.queue_for(name)
            models.append(
                ModelState(
                    name=name,
                    queue=queue,
                    depth=waiting[queue].requests,  # a bulk message counts the requests it carries
                    max_queue_depth=model.max_queue_depth,
                    oldest_waiting_s=oldest_waiting_age_s(client, queue, now_s),
                    drain_rate_per_s=admission.drain_rate_per_s(name),
                    workers=[w for w in workers if w.get("model") == name],
                    configured_version=model.version or _card_version(client, name, model.path),
                    direct_depth=_direct_depth(client, settings, name, workers),
                )
            )
    except redis.RedisError as exc:
        return FleetState(redis_error=describe_redis_error(exc, settings))
    return FleetState(redis_error=None, models=models, workers=workers)


def _direct_depth(client: redis.Redis[bytes], settings: FleetSettings, model: str,
                  workers: list[dict[str, Any]]) -> int:  # fmt: skip
    """Requests waiting in the own queues of ``model``'s live workers and of those registered as consuming one
    (a dead one included while live workers still watch it), in one round trip after the registry's read."""
    hosts = {str(w["hostname"]) for w in workers if w.get("model") == model and w.get("hostname")}
    for raw in client.zrange(DIRECT_QUEUES_KEY.format(model=model), 0, -1):
        hosts.add(raw.decode() if isinstance(raw, bytes) else str(raw))
    if not hosts:
        return 0
    with client.pipeline(transaction=False) as pipe:
        for host in sorted(hosts):
            pipe.llen(settings.direct_queue_for(model, host))
        return sum(int(n) for n in pipe.execute())


def _card_version(client: redis.Redis[bytes], model: str, path: Path) -> str | None:
    """The version in the model's card: the file next to the model, else the copy a worker published."""
    try:
        if card_path_for(path).exists():
            return load_card(path).version
        raw = client.get(CARD_KEY.format(model=model))
        return ModelCard.model_validate_json(raw).version if raw else None
    except (ModelLoadError, ValueError):
        return None


def readiness_problems(state: FleetState, models: list[str] | None = None) -> list[str]:
    """Why the fleet is not ready to serve ``models`` (default: every configured model); [] = ready."""
    if state.redis_error:
        return [state.redis_error]
    wanted = models if models is not None else [m.name for m in state.models]
    by_name = {m.name: m for m in state.models}
    problems = []
    for name in wanted:
        m = by_name.get(name)
        if m is None:
            problems.append(f"model {name!r} is not configured")
        elif m.ready_workers == 0:
            starting = len(m.workers)
            problems.append(
                f"model {name!r} has no ready worker ({starting} starting)"
                if starting
                else f"model {name!r} has no worker"
            )
    return problems
