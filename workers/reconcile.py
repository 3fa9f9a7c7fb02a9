"""The reconciler: makes this worker serve the versions the desired state in Redis names.

How a worker learns of a change, and why both ways: it subscribes to ``fleet:model-changes``
(pub/sub: the worker hears a change within milliseconds) **and** re-reads
``fleet:model-state:<model>`` every ``worker.reconcile_interval_s`` (default 5 s), because pub/sub
drops messages sent while the subscriber is reconnecting; the periodic read makes a worker that
missed a message converge. A worker reads the state before it takes its first request
(:meth:`Reconciler.initial` loads the pinned stable version; :meth:`Reconciler.sync` then loads a
canary), so one that was down during a change starts on the versions in force.

A change is applied off the request path: fetch and verify (:func:`workers.engines.load_version`:
every file's sha256 against the manifest), open the session, warm it up, then swap between batches
(:meth:`workers.runtime.WorkerRuntime.swap`). A version that cannot be loaded (ChecksumMismatch,
VersionNotFound, a load error) is recorded with :func:`protocol.model_state.record_refusal` and the
old version keeps serving; it is not retried until the state changes (its ``generation`` grows).

While the model has a canary the reconciler wakes every ``models.<m>.canary.check_interval_s``
and runs :func:`protocol.model_state.guard_canary`, which rolls a failing canary back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import redis

from protocol.model_state import CHANGES_CHANNEL, ModelState, guard_canary, read_state, record_refusal
from protocol.redis_conn import await_subscription, sync_client
from protocol.settings import FleetSettings
from workers.engines import LoadedModel, load_version
from workers.reconcile_plan import Held, plan, wanted_stable
from workers.scheduler import Role

if TYPE_CHECKING:
    from workers.runtime import WorkerRuntime

__all__ = ["Reconciler"]

log = logging.getLogger("fleet.reconcile")

RETRY_AFTER_ERROR_S = 1.0
"""Pause after a Redis error before the reconciler reconnects (s)."""


class Reconciler:
    """One thread per worker process: pub/sub + periodic re-read + the canary guard."""

    def __init__(self, client: redis.Redis[bytes], settings: FleetSettings, model: str, hostname: str) -> None:
        self.redis = client
        self.settings = settings
        self.model = model
        self.hostname = hostname
        self.runtime: WorkerRuntime | None = None
        self._configured = settings.models[model].store_version
        self.applied_stable: str | None = None
        """The stable version asked for and loaded; None = the configured one."""
        self.canary_active = False
        """The state has a canary: per-request outcomes are recorded (zero cost otherwise)."""
        self.last_refusal: dict[str, Any] | None = None
        """The last version this worker refused (heartbeat ``last_refusal``): version, error_type, error, at_unix_s."""
        self._refused: dict[str, int] = {}
        """Version -> state generation at which it was refused (not retried until the state changes)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleet-reconciler", daemon=True)

    # -- start-up -------------------------------------------------------------------------------
    def initial(self) -> LoadedModel:
        """Load the stable version in force (the pinned one, else the configured one).

        A pinned version that cannot be loaded is recorded as refused and the configured one is
        loaded instead.

        Raises:
            Exception: the configured version itself cannot be loaded (the worker must not start).
        """
        try:
            state = read_state(self.redis, self.model)
        except redis.RedisError as exc:
            log.warning("cannot read the model state at start (loading the configured version): %s", exc)
            state = None
        wanted = wanted_stable(state, self._configured)
        if wanted != self._configured:
            try:
                loaded = load_version(self.settings, self.model, wanted)
                self.applied_stable = wanted
                return loaded
            except Exception as exc:
                self._refuse(wanted or "configured", state, exc)
        self.applied_stable = self._configured
        return load_version(self.settings, self.model)

    def attach(self, runtime: WorkerRuntime) -> None:
        """The runtime whose engines this reconciler swaps."""
        self.runtime = runtime

    def start(self) -> None:
        """Apply the state once (a canary is loaded before the first request), then start the thread."""
        self.sync()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (waits briefly)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    # -- one pass -------------------------------------------------------------------------------
    def sync(self) -> ModelState | None:
        """Read the state and load / swap / drop versions until this worker matches it (see
        :func:`workers.reconcile_plan.plan`). A failed read changes nothing: the worker keeps what it serves."""
        runtime = self.runtime
        assert runtime is not None, "attach() the runtime first"
        try:
            state = read_state(self.redis, self.model)
        except redis.RedisError as exc:
            log.warning("cannot read the model state (serving what is loaded): %s", exc)
            return None
        self.canary_active = state is not None and state.canary is not None
        held = Held(self.applied_stable, runtime.canary.version if runtime.canary is not None else None)
        steps = plan(state, self._configured, held, self._refused)
        if steps.promote_canary and runtime.canary is not None:
            self._swap("stable", runtime.canary, runtime.canary.version)  # its engine becomes stable, no reload
        elif steps.load_stable:
            self._load("stable", steps.stable, state)
        if steps.drop_canary:
            runtime.swap("canary", None)
            log.info("worker %s dropped its canary: canary-queue requests now run on stable", self.hostname)
        if steps.load_canary is not None:
            self._load("canary", steps.load_canary, state)
        return state

    def _load(self, role: Role, version: str | None, state: ModelState | None) -> None:
        try:
            loaded = load_version(self.settings, self.model, version)
        except Exception as exc:  # any load failure: refuse it, keep serving the old version
            self._refuse(version or "configured", state, exc)
            return
        log.info("worker %s loaded %s %s in %.0f ms (warm-up %.0f ms)", self.hostname, self.model,
                 loaded.version, loaded.load_ms, loaded.warmup_ms)
        self._swap(role, loaded, version)

    def _swap(self, role: Role, loaded: LoadedModel, version: str | None) -> None:
        runtime = self.runtime
        assert runtime is not None
        if role == "stable":
            runtime.swap("stable", loaded)
            self.applied_stable = version
        else:
            runtime.swap("canary", loaded)
        log.info("worker %s serves %s %s as %s from the next batch", self.hostname, self.model, loaded.version, role)

    def _refuse(self, version: str, state: ModelState | None, exc: BaseException) -> None:
        self._refused[version] = state.generation if state is not None else 0
        log.error("worker %s refuses %s %s, keeps serving its current version: %s", self.hostname, self.model,
                  version, exc)
        self.last_refusal = {"version": version, "error_type": type(exc).__name__, "error": str(exc),
                             "at_unix_s": time.time()}
        try:
            record_refusal(self.redis, self.model, self.hostname, version, exc)
        except redis.RedisError as err:
            log.warning("could not record the refusal: %s", err)

    # -- the thread -----------------------------------------------------------------------------
    def _wait_s(self) -> float:
        interval = self.settings.worker.reconcile_interval_s
        if self.canary_active:
            interval = min(interval, self.settings.models[self.model].canary.check_interval_s)
        return interval

    def _loop(self) -> None:
        subscriber = sync_client(self.settings, socket_timeout=None)  # one pool; pubsub objects come and go
        pubsub: Any = None
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = subscriber.pubsub()
                    pubsub.subscribe(CHANGES_CHANNEL)
                    await_subscription(pubsub, CHANGES_CHANNEL, time.monotonic() + 5.0)  # then the read
                    self.sync()  # a change may have been published while we were not subscribed
                deadline = time.monotonic() + self._wait_s()
                while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
                    message = pubsub.get_message(timeout=min(left, 1.0))
                    if message is not None and _names(message, self.model):
                        break
                if self._stop.is_set():
                    break
                state = self.sync()
                if state is not None and state.canary is not None:
                    verdict = guard_canary(self.redis, self.settings, self.model,
                                           one_caller_per_s=self.settings.model(self.model).canary.check_interval_s)
                    if verdict is not None and verdict.rollback:
                        log.warning("canary %s of %s rolled back: %s", state.canary, self.model, verdict.reason)
                        self.sync()
            except redis.RedisError as exc:
                log.warning("reconciler lost Redis (%s); reconnecting", exc)
                _close(pubsub)
                pubsub = None
                self._stop.wait(RETRY_AFTER_ERROR_S)
            except Exception:  # never let the reconciler die: the worker would stop following changes
                log.exception("reconciler pass failed")
                self._stop.wait(RETRY_AFTER_ERROR_S)
        _close(pubsub)
        subscriber.close()


def _names(message: dict[str, Any], model: str) -> bool:
    if message.get("type") != "message":  # a subscribe confirmation carries a count
        return False
    data = message.get("data")
    return (data.decode() if isinstance(data, bytes) else str(data)) == model


def _close(pubsub: Any) -> None:
    if pubsub is not None:
        with contextlib.suppress(redis.RedisError):
            pubsub.close()
