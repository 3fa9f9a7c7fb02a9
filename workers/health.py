"""Worker registry: each worker publishes a heartbeat hash to Redis with a TTL.

Key ``fleet:worker:<hostname>`` holds a JSON document (hostname, model, the stable ``version`` and
``version_since_unix_s``, ``canary_version``, ``last_refusal``, active providers, ``nodes`` (the
stable graph's node count per provider, :attr:`workers.engine.Engine.placement`; null when
``engine.report_placement`` is off), ``kv_cache`` (which KV cache generates, its element type and, in place,
where its slots live: :func:`workers.worker_runtime.kv_cache_doc`; null for a model that does not generate), ready,
concurrency = tokens, in-flight, batches run, pid, queue
and canary queue, ``heartbeat_unix_s``, ``heartbeat_s`` its period, ``instance`` one per process: only
the process that wrote it deletes it, :mod:`workers.namesakes`) that expires after three heartbeat
periods, so a dead worker disappears by itself. ``ready`` is false while the worker loads, while it
holds work it does not progress (``held`` requests, ``stalled_s`` without progress, ``overdue_slots``:
:mod:`workers.progress`), while its engine fails every run (``failed_runs`` in a row), once a thread it
needs died, and from the moment a shutdown begins (``shutting_down``: a warm shutdown takes nothing more
while it drains); ``not_ready`` says why in words (null when ready), which ``fleet probe ready`` prints.
A shutdown, the scheduler thread's death and the engine's failing (or succeeding again) are published at once
(:meth:`Heartbeat.beat_soon`), not at the next period; such a beat says ``beat_at_once: true``.
``fleet:model:<name>:card`` holds the model card, so producers on other machines can validate and
tokenize without the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from protocol.keys import CARD_KEY, LIVE_WORKERS_KEY, WORKER_KEY_PREFIX
from workers.namesakes import BEAT_SCRIPT, RELEASE_SCRIPT, STALE_PERIODS
from workers.redis_outage import OutageLog

__all__ = ["Heartbeat", "list_workers", "next_beat_in_s", "read_card_json"]

log = logging.getLogger("fleet.health")


class Heartbeat:
    """Publishes ``snapshot()`` every ``period_s`` seconds until stopped."""

    def __init__(
        self, client: redis.Redis[bytes], hostname: str, snapshot: Callable[[], dict[str, Any]], period_s: float
    ) -> None:
        self._client = client
        self._beat_script = client.register_script(BEAT_SCRIPT)
        self._release_script = client.register_script(RELEASE_SCRIPT)
        self._key = WORKER_KEY_PREFIX + hostname
        self._hostname = hostname
        self._model: str | None = None
        self._snapshot = snapshot
        self._period_s = period_s
        self._stop = threading.Event()
        self._soon = threading.Event()
        self._outage = OutageLog(log, "heartbeat to Redis failed")
        """Set by :meth:`beat_soon` (and :meth:`stop`): the beating thread beats now, besides its schedule."""
        self._thread = threading.Thread(target=self._loop, name="fleet-heartbeat", daemon=True)
        self.instance = uuid.uuid4().hex
        """Marks this process's beats (``instance`` in the document): a stop deletes only its own
        (:mod:`workers.namesakes`)."""
        self._ceded = False
        """The last beat found the name held by a live worker of another process (logged once per loss)."""
        self.published_monotonic_s: float | None = None
        """When the last beat reached Redis (``time.monotonic()``); None before the first."""
        self.on_beat: list[Callable[[float], None]] = []
        """Called after each published beat with the heartbeat's expiry (unix s), on the beating thread;
        whatever one raises is logged, and the next one still runs."""
        self.on_ceded: list[Callable[[dict[str, Any]], None]] = []
        """Called once per loss of the name, on the beating thread, with the holder's heartbeat: a live worker of
        another process took this name while this one did not beat (stopped, frozen, cut off from Redis). No beat
        of this process is published from then on, so neither are the :attr:`on_beat` hooks run: its generations'
        claims and its deliveries' visibility are no longer renewed (:mod:`workers.run_claims`)."""

    @property
    def ttl_s(self) -> int:
        """Seconds a beat keeps this worker live: three heartbeat periods, rounded up."""
        return max(1, int(self._period_s * 3 + 0.999))

    def start(self) -> None:
        """Publish once now, then every period."""
        self.beat()
        self._thread.start()

    def claim(self) -> dict[str, Any] | None:
        """The first beat, before the worker takes any message: None when it was published (or Redis did not
        answer: not a reason to refuse), else the heartbeat of the live worker of another process that holds
        this name (nothing was written; :data:`~workers.namesakes.BEAT_SCRIPT`)."""
        return self._beat_once()

    def beat(self, *, at_once: bool = False) -> None:
        """Publish the current snapshot, and this worker in its model's live set, unless a live worker of
        another process holds the name now (errors are logged: Redis may be restarting). ``at_once``: the beat
        :meth:`beat_soon` asked for, off the schedule; the heartbeat's ``beat_at_once`` says so to its readers."""
        holder = self._beat_once(at_once=at_once)
        if holder is None:
            self._ceded = False
        elif not self._ceded:  # once per loss: its beats are not published while the other one lives
            self._ceded = True
            log.error("heartbeat %s belongs to a live worker of another process (pid %s): this worker's beats are "
                      "not published while it lives", self._key, holder.get("pid", "?"))  # fmt: skip
            for hook in self.on_ceded:
                try:
                    hook(holder)
                except Exception:  # a hook's failure must not stop the heartbeat
                    log.exception("heartbeat hook %s failed", getattr(hook, "__name__", hook))

    def beat_soon(self) -> None:
        """Have the beating thread publish a beat now, besides its schedule (which this beat does not move): what
        readiness says changed (a shutdown began, a thread died, the engine fails). Sets an event and returns, so
        it may be called from a signal handler or the scheduler's thread: a beat's Redis round trips run on the
        beating thread (a beat from a signal handler could wait on a connection the interrupted thread holds)."""
        self._soon.set()

    def _beat_once(self, *, at_once: bool = False) -> dict[str, Any] | None:
        try:
            now = time.time()
            doc = {**self._snapshot(), "heartbeat_unix_s": now, "heartbeat_s": self._period_s,
                   "instance": self.instance, "beat_at_once": at_once}
            ttl_s = self.ttl_s
            model = str(doc["model"]) if doc.get("model") else None
            if model is not None:
                self._model = model
            held = self._beat_script(self._script_keys(model), [json.dumps(doc), self.instance, ttl_s, repr(now),
                                                                self._hostname, repr(STALE_PERIODS)])  # fmt: skip
        except redis.RedisError as exc:
            self._outage.failed(exc, time.monotonic())
            return None
        self._outage.recovered(time.monotonic())
        if held is not None:
            try:
                holder = json.loads(held)
            except ValueError:
                holder = {}
            return holder if isinstance(holder, dict) else {}
        self.published_monotonic_s = time.monotonic()
        self._run_hooks(now + ttl_s)
        return None

    @property
    def live(self) -> bool:
        """True while the last published beat has not expired in Redis (within :attr:`ttl_s`): what every reader
        of the heartbeat (``fleet probe ready``, ``/readyz``, the router) sees of this worker. False when Redis
        has not taken a beat for that long (down, unreachable, refusing writes) or this name is ceded."""
        published = self.published_monotonic_s
        return published is not None and not self._ceded and time.monotonic() - published < self.ttl_s

    def _script_keys(self, model: str | None) -> list[str]:
        """The KEYS of :data:`~workers.namesakes.BEAT_SCRIPT` and ``RELEASE_SCRIPT``: the heartbeat, and
        ``model``'s live set when the worker serves one."""
        return [self._key] + ([LIVE_WORKERS_KEY.format(model=model)] if model else [])

    def _run_hooks(self, expires_unix_s: float) -> None:
        for hook in self.on_beat:
            try:
                hook(expires_unix_s)
            except redis.RedisError as exc:
                log.warning("heartbeat hook %s: Redis failed: %s", getattr(hook, "__name__", hook), exc)
            except Exception:  # a hook's bug must not stop the heartbeat (the worker would look dead)
                log.exception("heartbeat hook %s failed", getattr(hook, "__name__", hook))

    def stop(self) -> None:
        """Stop publishing and remove the key (and this worker from its model's live set)."""
        self._stop.set()
        self._soon.set()
        if self._thread.is_alive():
            self._thread.join(self._period_s * 2)
        with contextlib.suppress(redis.RedisError):  # a namesake's heartbeat and live entry are left alone
            if not self._release_script(self._script_keys(self._model), [self.instance, self._hostname]):
                log.warning("heartbeat %s now belongs to another process under the same name: left in place",
                            self._key)  # fmt: skip

    def _loop(self) -> None:
        started = time.monotonic()
        while True:
            soon = self._soon.wait(next_beat_in_s(started, time.monotonic(), self._period_s))
            if self._stop.is_set():
                return
            if soon:  # cleared before the beat: a change after its snapshot is published by the next one
                self._soon.clear()
            else:
                started = time.monotonic()
            self.beat(at_once=soon)


def next_beat_in_s(last_started_s: float, now_s: float, period_s: float) -> float:
    """Seconds until the next beat: beats start every ``period_s`` (monotonic s), whatever the last one and its
    hooks took, never at once after another (at least a tenth of the period between them). Waiting a whole
    period *after* a beat and its hooks (five round trips) spaced beats by the period plus those round trips,
    while a beat lives three periods: on a link of 200 ms with 5 % loss and ``heartbeat_s`` 0.5, the worker's
    key was missing 33-46 % of the time while it served fine."""
    return max(period_s / 10, last_started_s + period_s - now_s)


def list_workers(client: redis.Redis[bytes]) -> list[dict[str, Any]]:
    """Every live worker's latest heartbeat document, sorted by hostname."""
    docs = []
    for key in client.scan_iter(match=WORKER_KEY_PREFIX + "*", count=200):
        raw = client.get(key)
        if raw:
            docs.append(json.loads(raw))
    return sorted(docs, key=lambda d: str(d.get("hostname")))


def read_card_json(client: redis.Redis[bytes], model: str) -> str | None:
    """The model card a worker of ``model`` published, or None."""
    raw = client.get(CARD_KEY.format(model=model))
    return raw.decode() if isinstance(raw, bytes) else raw
