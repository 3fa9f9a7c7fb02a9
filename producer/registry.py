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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from broker import pipe_waiting_counts, queue_lists
from producer.admission import drain_rate_per_s
from protocol.errors import ModelLoadError
from protocol.keys import CARD_KEY, DIRECT_QUEUES_KEY, DRAIN_KEY, WORKER_KEY_PREFIX
from protocol.modelcard import ModelCard, card_path_for, load_card
from protocol.redis_conn import describe_redis_error
from protocol.settings import FleetSettings

__all__ = [
    "FleetState",
    "ModelState",
    "list_workers",
    "message_submitted_at",
    "oldest_waiting_age_s",
    "oldest_waiting_ages_s",
    "pipe_list_workers",
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


Replies = Iterator[Any]
"""The replies of one ``pipe.execute()``, read in the order the commands were queued."""


def list_workers(client: redis.Redis[bytes]) -> list[dict[str, Any]]:
    """Every live worker's latest heartbeat document, sorted by hostname."""
    keys = _worker_keys(client)
    return _worker_docs(client.mget(keys) if keys else [])


def pipe_list_workers(client: redis.Redis[bytes],
                      pipe: redis.client.Pipeline[bytes]) -> Callable[[Replies], list[dict[str, Any]]]:  # fmt: skip
    """:func:`list_workers` for a caller reading more in one pipeline: ``SCAN`` the heartbeat keys now (one
    round trip per 500 keys of the keyspace), queue their ``MGET`` on ``pipe``; returns what reads the documents
    from ``pipe.execute()``'s replies at the position the ``MGET`` was queued at (none queued, nor read, for no
    live worker)."""
    keys = _worker_keys(client)
    if keys:
        pipe.mget(keys)
    return lambda replies: _worker_docs(next(replies)) if keys else []


def _worker_keys(client: redis.Redis[bytes]) -> list[bytes]:
    """The live workers' heartbeat keys (``SCAN``: one round trip per 500 keys of the whole keyspace)."""
    return sorted(client.scan_iter(match=WORKER_KEY_PREFIX + "*", count=500))


def _worker_docs(raws: list[bytes | None]) -> list[dict[str, Any]]:
    """The heartbeat documents among ``raws`` (expired and unreadable ones left out), sorted by hostname."""
    docs = []
    for raw in raws:
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
    """Age (s) of the oldest request waiting in ``queue`` (:func:`oldest_waiting_ages_s` of that queue alone)."""
    return oldest_waiting_ages_s(client, [queue], now_s)[queue]


def oldest_waiting_ages_s(client: redis.Redis[bytes], queues: list[str], now_s: float) -> dict[str, float | None]:
    """Age (s) of the oldest request waiting in each of ``queues``: the tails of each one's own list and kombu's
    priority siblings (:func:`broker.queue_lists`), every queue's read in one round trip (one pipeline, not one
    per queue); None for a queue that is empty or holds no fleet request."""
    with client.pipeline(transaction=False) as pipe:
        ages = _queue_oldest(pipe, queues, now_s)
        return ages(iter(pipe.execute()))


def _queue_oldest(pipe: redis.client.Pipeline[bytes], queues: list[str],
                  now_s: float) -> Callable[[Replies], dict[str, float | None]]:  # fmt: skip
    """Queue the ``LINDEX -1`` of every list of ``queues`` on ``pipe``; returns what reads their replies into
    :func:`oldest_waiting_ages_s`'s ages."""
    lists = {queue: queue_lists(queue) for queue in queues}
    for listed in lists.values():
        for name in listed:
            pipe.lindex(name, -1)

    def read(replies: Replies) -> dict[str, float | None]:
        ages: dict[str, float | None] = {}
        for queue, listed in lists.items():
            raws = [next(replies) for _ in listed]
            times = [t for t in (message_submitted_at(raw) for raw in raws if raw is not None) if t is not None]
            ages[queue] = max(0.0, now_s - min(times)) if times else None
        return ages

    return read


def read_fleet_state(settings: FleetSettings, client: redis.Redis[bytes], now_s: float | None = None) -> FleetState:
    """Heartbeats and queue figures for every configured model (never raises on a Redis outage).

    Round trips, however many models: the ``SCAN`` of the heartbeat keys (one per 500 keys of the keyspace), one
    pipeline that reads the heartbeats, every queue's waiting requests (one script) and oldest request, and each
    model's drain counters, direct-queue registry and published card, then one pipeline of the direct queues'
    lengths, which depend on the first one's answers (none without a live or registered worker). Before, each model cost
    3 or 4 of its own (its drain counters, registry, direct queues and published card): 74 for 20 models.
    """
    now_s = time.time() if now_s is None else now_s
    try:
        queues = [settings.queue_for(name) for name in settings.models]
        with client.pipeline(transaction=False) as pipe:
            workers_of = pipe_list_workers(client, pipe)
            waiting_of = pipe_waiting_counts(pipe, queues)
            oldest_of = _queue_oldest(pipe, queues, now_s)
            per_model = {name: _queue_model_reads(pipe, settings, name, now_s) for name in settings.models}
            replies = iter(pipe.execute())
        workers = workers_of(replies)
        waiting, oldest = waiting_of(replies), oldest_of(replies)
        reads = {name: read(replies) for name, read in per_model.items()}
        direct = _direct_depths(client, settings, {name: r.direct_hosts for name, r in reads.items()}, workers)
    except redis.RedisError as exc:
        return FleetState(redis_error=describe_redis_error(exc, settings))
    models = []
    for name, model in settings.models.items():
        queue = settings.queue_for(name)
        models.append(
            ModelState(
                name=name,
                queue=queue,
                depth=waiting[queue].requests,  # a bulk message counts the requests it carries
                max_queue_depth=model.max_queue_depth,
                oldest_waiting_s=oldest[queue],
                drain_rate_per_s=reads[name].drain_rate_per_s,
                workers=[w for w in workers if w.get("model") == name],
                configured_version=model.version or reads[name].card_version,
                direct_depth=direct[name],
            )
        )
    return FleetState(redis_error=None, models=models, workers=workers)


@dataclass(frozen=True)
class _ModelReads:
    """What the first pipeline of :func:`read_fleet_state` read for one model."""

    drain_rate_per_s: float
    card_version: str | None
    direct_hosts: set[str]
    """Hosts registered as consuming an own queue of the model (``fleet:direct:<model>``)."""


def _queue_model_reads(pipe: redis.client.Pipeline[bytes], settings: FleetSettings, name: str,
                       now_s: float) -> Callable[[Replies], _ModelReads]:  # fmt: skip
    """Queue ``name``'s drain counters (:meth:`producer.admission.Admission.drain_rate_per_s`'s keys), its
    direct-queue registry and, without a version configured or a card file next to the model, the card a worker
    published; returns what reads their replies."""
    model = settings.models[name]
    window_s = settings.admission.drain_window_s
    seconds = list(range(int(now_s) - max(1, int(window_s)) + 1, int(now_s) + 1))
    pipe.mget([DRAIN_KEY.format(model=name, second=s) for s in seconds])
    pipe.zrange(DIRECT_QUEUES_KEY.format(model=name), 0, -1)
    card_file = None if model.version else _card_file_version(model.path)
    if not model.version and card_file is None:
        pipe.get(CARD_KEY.format(model=name))

    def read(replies: Replies) -> _ModelReads:
        counts = {s: int(v) for s, v in zip(seconds, next(replies), strict=True) if v is not None}
        hosts = {raw.decode() if isinstance(raw, bytes) else str(raw) for raw in next(replies)}
        version = card_file.version if card_file is not None else None
        if not model.version and card_file is None:
            version = _published_card_version(next(replies))
        return _ModelReads(drain_rate_per_s(counts, now_s, window_s), version, hosts)

    return read


def _direct_depths(client: redis.Redis[bytes], settings: FleetSettings, registered: dict[str, set[str]],
                   workers: list[dict[str, Any]]) -> dict[str, int]:  # fmt: skip
    """Requests waiting in the own queues of each model's live workers and of those registered as consuming one
    (a dead one included while live workers still watch it): every model's in one pipeline (none without a host)."""
    hosts = {model: set(listed) for model, listed in registered.items()}
    for w in workers:
        if w.get("model") in hosts and w.get("hostname"):
            hosts[str(w["model"])].add(str(w["hostname"]))
    queues = {model: [settings.direct_queue_for(model, host) for host in sorted(listed)]
              for model, listed in hosts.items()}  # fmt: skip
    if not any(queues.values()):
        return dict.fromkeys(hosts, 0)
    with client.pipeline(transaction=False) as pipe:
        for listed in queues.values():
            for queue in listed:
                pipe.llen(queue)
        lengths = iter(pipe.execute())
    return {model: sum(int(next(lengths)) for _ in listed) for model, listed in queues.items()}


@dataclass(frozen=True)
class _CardFile:
    version: str | None


def _card_file_version(path: Path) -> _CardFile | None:
    """The version in the card file next to the model (None: there is no such file, read the published one)."""
    if not card_path_for(path).exists():
        return None
    try:
        return _CardFile(load_card(path).version)
    except (ModelLoadError, ValueError):
        return _CardFile(None)


def _published_card_version(raw: bytes | None) -> str | None:
    """The version in the card a worker published (``fleet:model:<name>:card``), None if absent or unreadable."""
    try:
        return ModelCard.model_validate_json(raw).version if raw else None
    except ValueError:
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
