"""The reconciler: makes this worker serve the versions the desired state in Redis names.

How a worker learns of a change, and why both ways: it subscribes to ``fleet:model-changes``
(pub/sub: the worker hears a change within milliseconds) **and** re-reads
``fleet:model-state:<model>`` every ``worker.reconcile_interval_s`` (default 5 s), because pub/sub
drops messages sent while the subscriber is reconnecting; the periodic read makes a worker that
missed a message converge. A worker reads the state before it takes its first request
(:meth:`Reconciler.initial` loads the pinned stable version; :meth:`Reconciler.sync` then loads a
canary), so one that was down during a change starts on the versions in force. A starting worker
that cannot load the pinned version serves the last version the fleet served
(:mod:`protocol.model_served`, appended each time a worker puts a stable version in service), not
its configured one, so that stable traffic keeps one version.

A change is applied off the request path: fetch and verify (:func:`workers.engines.load_version`:
every file's sha256 against the manifest), open the session, warm it up, then swap between batches
(:meth:`workers.runtime.WorkerRuntime.swap`). A load runs on a thread of its own (at most one per
role, :func:`workers.reconcile_plan.to_start`), never on the reconciler's: a change that needs no
load (a canary dropped by a rollback or by the guard, a promotion of the held canary) is applied the
moment its notice arrives, even while a seconds-long load of another version runs; the guard keeps
its turns meanwhile. When a load ends, the state is read again and the version goes where it now
names it (:func:`workers.reconcile_plan.landing_role`), or is discarded unserved. Passes and the ends
of loads take one lock, so swaps and refusals happen one at a time, as on a single thread.

A load the state stops naming (a pin replaced, a canary rolled back, during its load) is superseded: a
pass marks it, and it stops at its next step (:mod:`workers.version_loads`); its replacement does not
wait for it, but starts on a new thread at once, even while the superseded one is stuck in a read of a
hung store. What a superseded load brings back is discarded, never swapped in, and its failure is not a
refusal. At most one superseded load per role runs beside the current one; a further change while both
run waits until one of them ends (logged). Memory: a worker briefly holds up to six engines (two serving,
and per role one loading and one superseded; :mod:`workers.version_loads`), two in steady state.

A load is held to the manifest digest the state recorded for its version (:func:`_digest`; a state without
one checks nothing): a manifest changed since the pin is refused, so no worker serves other bytes under the name.

A version that cannot be loaded (ChecksumMismatch, VersionNotFound, a load error) is recorded with
:func:`protocol.model_state.record_refusal` and the old version keeps serving; it is not retried
until the state changes (its ``generation`` grows). A load that failed because the store did not answer
(unreachable, a timeout, a reset, a 5xx or throttle: :func:`workers.load_retry.transient`) is no verdict on
the version: it is recorded and logged once per outage, and the periodic re-read tries it again after
``worker.reconcile_interval_s``, doubling up to :data:`workers.load_retry.MAX_RETRY_WAIT_S`
(:class:`workers.load_retry.LoadRetries`), so a worker that started or was told of a pin during a store
outage converges once the store is back, with no new pin.
A worker without a model store can load one version by name, its configured file's
(:func:`store.resolve.configured_file_version`): a pin or canary of that version is served, any
other is refused (ConfigError). A canary the state no longer names (rolled back, or replaced by
another) leaves the canary slot at once, even when its successor is then refused
(:func:`workers.reconcile_plan.plan`).

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

from protocol.model_served import last_served, read_served, record_served
from protocol.model_state import CHANGES_CHANNEL, ModelState, guard_canary, read_state, record_refusal
from protocol.redis_conn import LISTEN_WAIT_S, await_subscription, sync_client
from protocol.settings import FleetSettings
from store.resolve import configured_file_version
from workers.engines import LoadedModel, load_version
from workers.load_retry import MAX_RETRY_WAIT_S, LoadRetries, transient
from workers.reconcile_plan import Held, landing_role, plan, to_start, wanted_stable
from workers.redis_outage import OutageLog
from workers.scheduler import Role
from workers.version_loads import VersionLoad, VersionLoads

if TYPE_CHECKING:
    from workers.runtime import WorkerRuntime

__all__ = ["Reconciler"]

log = logging.getLogger("fleet.reconcile")

RETRY_AFTER_ERROR_S = 1.0
"""Pause after a Redis error before the reconciler reconnects (s)."""


class Reconciler:
    """One thread per worker process (pub/sub + periodic re-read + the canary guard), and one per load in flight."""

    def __init__(self, client: redis.Redis[bytes], settings: FleetSettings, model: str, hostname: str) -> None:
        self.redis = client
        self.settings = settings
        self.model = model
        self.hostname = hostname
        self.runtime: WorkerRuntime | None = None
        self._configured = settings.models[model].store_version
        self._file_version = configured_file_version(settings, model)
        """Without a store: the configured file's version label (a pin of it is the configured file)."""
        self.applied_stable: str | None = None
        """The stable version asked for and loaded; None = the configured one."""
        self.applied_stable_sha256: str | None = None
        """The manifest digest the stable version was loaded under (None: none asked for)."""
        self._initial: tuple[str, int, str | None] | None = None
        """The version label :meth:`initial` loaded and the state generation it read (recorded as served at start)."""
        self.canary_active = False
        """The state has a canary: per-request outcomes are recorded (zero cost otherwise)."""
        self.last_refusal: dict[str, Any] | None = None
        """The last version this worker refused (heartbeat ``last_refusal``): version, error_type, error, at_unix_s."""
        self._refused: dict[str, int] = {}
        """Version -> state generation at which it was refused (not retried until the state changes)."""
        self._retries = LoadRetries(settings.worker.reconcile_interval_s)
        """The versions the store could not deliver (transient failures), and when each is tried again."""
        self._lock = threading.Lock()
        """Serialises the passes and the ends of loads (state read, swaps, refusals); never held during a load."""
        self._settled = threading.Condition(self._lock)
        """Notified whenever a load ends."""
        self._loads = VersionLoads(f"worker {hostname}", model)
        """The loads in flight: per role the current one and at most one superseded (abandoned) one."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleet-reconciler", daemon=True)

    # -- start-up -------------------------------------------------------------------------------
    def initial(self) -> LoadedModel:
        """Load the stable version in force (the pinned one, else the configured one).

        A pinned version that cannot be loaded is recorded as refused (or, when the store did not answer,
        as a failure the periodic re-read tries again: :mod:`workers.load_retry`); the worker then serves
        the last version the fleet served (:func:`protocol.model_served.last_served`), else its
        configured one.

        Raises:
            Exception: neither the pinned, the last served nor the configured version can be loaded
                (the worker must not start).
        """
        try:
            state = read_state(self.redis, self.model)
        except redis.RedisError as exc:
            log.warning("cannot read the model state at start (loading the configured version): %s", exc)
            state = None
        generation = state.generation if state is not None else 0
        wanted = wanted_stable(state, self._configured)
        loaded: LoadedModel | None = None
        if wanted != self._configured and not (wanted is not None and wanted == self._file_version):
            try:
                loaded = load_version(self.settings, self.model, wanted, manifest_sha256=_digest(state, wanted))
                self.applied_stable = wanted
            except Exception as exc:
                self._refuse(wanted or "configured", state, exc,
                             "at start (serving the version the fleet last served, else its configured one)")
                loaded = self._load_last_served(wanted)
        if loaded is None:
            self.applied_stable = self._configured
            loaded = load_version(self.settings, self.model)
        self.applied_stable_sha256 = loaded.manifest_sha256
        self._initial = (loaded.version, generation, loaded.loaded_manifest_sha256)
        return loaded

    def _load_last_served(self, refused: str | None) -> LoadedModel | None:
        """The last version the fleet served (other than ``refused`` and the configured one), loaded; None
        when there is none or it cannot be loaded either (the caller then loads the configured one)."""
        try:
            entry = last_served(read_served(self.redis, self.model), other_than=(refused,))
        except redis.RedisError as exc:
            log.warning("cannot read the versions the fleet served (loading the configured version): %s", exc)
            return None
        if entry is None or entry.store_version is None or entry.store_version == self._configured:
            log.warning("worker %s serves its configured %s version %s: no other version was served before it",
                        self.hostname, self.model, self._configured or "(file)")
            return None
        try:
            # held to the manifest it was served from (an entry an older worker wrote has none: not checked)
            loaded = load_version(self.settings, self.model, entry.store_version, manifest_sha256=entry.manifest_sha256)
        except Exception as exc:
            log.error("worker %s cannot load %s %s, the version the fleet last served, either (serving its "
                      "configured version): %s", self.hostname, self.model, entry.store_version, exc)
            return None
        log.warning("worker %s serves %s %s, the version the fleet last served (%s, %.0f s ago), not the desired "
                    "%s, which it refused", self.hostname, self.model, entry.store_version, entry.worker,
                    max(0.0, time.time() - entry.at_unix_s), refused)
        self.applied_stable = entry.store_version
        return loaded

    def attach(self, runtime: WorkerRuntime) -> None:
        """The runtime whose engines this reconciler swaps."""
        self.runtime = runtime

    def start(self) -> None:
        """Record the version :meth:`initial` loaded as served, apply the state once and wait for its loads
        (a canary is loaded before the first request), then start the thread."""
        if self._initial is not None:
            self._record_served(self._initial[0], self.applied_stable, self._initial[1], self._initial[2])
        self.sync()
        self.wait_loaded()
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The reconciler's own thread, not a load's (its death makes the worker not ready)."""
        return self._thread

    def stop(self) -> None:
        """Stop the thread (waits briefly); a load still in flight stops at its next step and is discarded."""
        self._stop.set()
        with self._lock:
            self._loads.stop_all()
        if self._thread.is_alive():
            self._thread.join(5.0)

    # -- one pass -------------------------------------------------------------------------------
    def sync(self) -> ModelState | None:
        """Read the state and bring this worker towards it (see :func:`workers.reconcile_plan.plan`): the
        steps that need no load (drop the canary, promote the held canary) at once, and the loads begun
        on threads of their own (:meth:`_begin`), which swap the version in when they end. A failed read
        changes nothing: the worker keeps what it serves."""
        with self._lock:
            return self._pass()

    def _pass(self) -> ModelState | None:
        runtime = self.runtime
        assert runtime is not None, "attach() the runtime first"
        try:
            state = read_state(self.redis, self.model)
        except redis.RedisError as exc:
            log.warning("cannot read the model state (serving what is loaded): %s", exc)
            return None
        self.canary_active = state is not None and state.canary is not None
        canary = state.canary if state is not None else None
        self._retries.retain({wanted_stable(state, self._configured) or "configured", canary})
        steps = plan(state, self._configured, self._held(), self._refused, file_version=self._file_version,
                     retries=self._retries.pending, now_s=time.monotonic())
        if steps.promote_canary and runtime.canary is not None:
            # its engine becomes stable, no reload
            self._swap("stable", runtime.canary, runtime.canary.version, state)
        if steps.drop_canary and runtime.canary is not None:
            dropped = runtime.canary.version
            runtime.swap("canary", None)
            wanted = (state.canary if state is not None else None) or "none"
            log.info("worker %s emptied its canary slot (held %s; the state's canary: %s): canary-queue requests "
                     "now run on stable", self.hostname, dropped, wanted)
        held, generation = self._held(), state.generation if state is not None else 0
        self._loads.supersede(lambda role, version: landing_role(
            state, self._configured, version, role, held, self._loads.current[role].manifest_sha256) is not None,
            generation)  # marks the loads the state no longer names (a version pinned again: a new manifest)
        for role, version in to_start(steps, self._loads.versions()):
            self._begin(role, version, state)
        self._loads.log_waits(steps.loads, generation)
        return state

    def _held(self) -> Held:
        runtime = self.runtime
        assert runtime is not None
        canary = runtime.canary
        return Held(self.applied_stable, canary.version if canary is not None else None, self.applied_stable_sha256,
                    canary.manifest_sha256 if canary is not None else None)

    def _begin(self, role: Role, version: str | None, state: ModelState | None) -> None:
        """Load ``version`` for ``role`` on a thread of its own (the caller holds the lock): a fetch and
        warm-up take seconds, and a rollback that lands meanwhile must not wait for them."""
        load = self._loads.begin(role, version, _digest(state, version))
        thread = threading.Thread(target=self._load, args=(load, state), name=f"fleet-load-{role}", daemon=True)
        thread.start()

    def wait_loaded(self) -> None:
        """Block until no current load is in flight (the loads a pass began, and those the passes after them
        began); a superseded one may still run."""
        with self._lock:
            self._settled.wait_for(lambda: not self._loads.current)

    def _load(self, load: VersionLoad, state: ModelState | None) -> None:
        """The load thread: load, then (under the lock) swap it in where the state now wants it, or discard
        it, or record the refusal; then a pass applies what changed meanwhile (and begins the next load)."""
        role, version = load.role, load.version
        loaded: LoadedModel | None = None
        failure: Exception | None = None
        try:
            loaded = load_version(self.settings, self.model, version, manifest_sha256=load.manifest_sha256,
                                  stop=load.stop)
        except Exception as exc:  # any load failure: refuse it, keep serving the old version
            failure = exc
        with self._lock:
            try:
                self._loads.end(load)
                if self._stop.is_set():
                    return
                if load.superseded:
                    self._loads.discarded(load, failure)
                elif failure is not None:
                    self._refused_load(role, version, state, failure)
                elif loaded is not None:
                    log.info("worker %s loaded %s %s in %.0f ms (warm-up %.0f ms)", self.hostname, self.model,
                             loaded.version, loaded.load_ms, loaded.warmup_ms)
                    self._outage_ended(version or "configured")
                    target, current = self._still_wanted(role, version, state, load.manifest_sha256)
                    if target is not None:
                        self._swap(target, loaded, version, current)
                self._pass()
            except Exception:  # the periodic pass retries; never leave the role marked as loading
                log.exception("applying the load of %s %s as %s failed", self.model, version or "configured", role)
            finally:
                self._settled.notify_all()

    def _refused_load(self, role: Role, version: str | None, state: ModelState | None, exc: Exception) -> None:
        runtime = self.runtime
        serving = "?" if runtime is None else runtime.scheduler.stable.version
        if role == "canary" and runtime is not None and runtime.canary is not None:
            serving = runtime.canary.version
        then = f"keeps serving {serving} as {role}" if role == "stable" else f"its canary queue runs on {serving}"
        self._refuse(version or "configured", state, exc, then)

    def _still_wanted(
        self, role: Role, version: str | None, state: ModelState | None, manifest_sha256: str | None
    ) -> tuple[Role | None, ModelState | None]:
        """Where ``version``, loaded as ``role``, goes now that it is loaded (a fetch and warm-up take seconds:
        a rollback, a promote or another canary may have come meanwhile), with the state read: ``role``,
        the other role (:func:`workers.reconcile_plan.landing_role`), or None.

        When the state moved on, the loaded engine is discarded unserved (a version the state no longer
        names must not compute a single batch, nor be recorded as served); the pass that follows applies
        the new state. A state that cannot be read keeps the swap (the desired state as last read)."""
        try:
            now = read_state(self.redis, self.model)
        except redis.RedisError as exc:
            log.warning("cannot re-read the model state after loading %s (swapping it in): %s", version, exc)
            return role, state
        target = landing_role(now, self._configured, version, role, self._held(), manifest_sha256)
        if target is not None:
            if target != role:
                log.info("worker %s takes %s %s, loaded as %s, as %s: the state changed during its load",
                         self.hostname, self.model, version, role, target)
            return target, now
        wanted = wanted_stable(now, self._configured) if role == "stable" else (now.canary if now else None)
        log.info("worker %s discards %s %s, loaded as %s: the state no longer names it (generation %s; %s wanted: "
                 "%s)", self.hostname, self.model, version or "configured", role, now.generation if now else 0,
                 role, wanted or ("none" if role == "canary" else "configured"))
        return None, now

    def _swap(self, role: Role, loaded: LoadedModel, version: str | None, state: ModelState | None) -> None:
        runtime = self.runtime
        assert runtime is not None
        if role == "stable":
            runtime.swap("stable", loaded)
            self.applied_stable, self.applied_stable_sha256 = version, loaded.manifest_sha256
            self._record_served(loaded.version, version, state.generation if state is not None else 0,
                                loaded.loaded_manifest_sha256)
        else:
            runtime.swap("canary", loaded)
        log.info("worker %s serves %s %s as %s from the next batch", self.hostname, self.model, loaded.version, role)

    def _record_served(self, version: str, store_version: str | None, generation: int,
                       manifest_sha256: str | None) -> None:  # fmt: skip
        """Append the stable version now in service, with its manifest's digest (what a starting worker falls
        back to)."""
        try:
            record_served(self.redis, self.model, self.hostname, version, store_version or self._configured,
                          generation, manifest_sha256)
        except redis.RedisError as exc:
            log.warning("could not record the served version: %s", exc)

    def _refuse(self, version: str, state: ModelState | None, exc: BaseException, then: str) -> None:
        """Record the refusal; ``then`` says what the worker does instead (logged). A transient failure (the
        store did not answer) is tried again later (:meth:`_store_failed`), not refused."""
        generation = state.generation if state is not None else 0
        if transient(exc):
            self._store_failed(version, generation, exc, then)
            return
        self._retries.ended(version)  # the store answered, with a verdict
        self._refused[version] = generation
        log.error("worker %s refuses %s %s, %s: %s", self.hostname, self.model, version, then, exc)
        self._record_refusal(version, exc)

    def _store_failed(self, version: str, generation: int, exc: BaseException, then: str) -> None:
        """The store could not deliver ``version``: tried again later, with a backoff; the outage's first
        failure is logged and recorded as a refusal, the further ones only at DEBUG."""
        outage = self._retries.failed(version, generation, time.monotonic())
        if outage.failures > 1:
            log.debug("worker %s still cannot load %s %s, the store did not answer (failure %d of this outage; "
                      "next try in %.0f s): %s", self.hostname, self.model, version, outage.failures, outage.wait_s,
                      exc)
            return
        log.error("worker %s cannot load %s %s for now, %s: the store did not answer: %s; it tries again in %.0f s, "
                  "then at doubling waits up to %.0f s (further failures are logged at DEBUG until it loads)",
                  self.hostname, self.model, version, then, exc, outage.wait_s, MAX_RETRY_WAIT_S)
        self._record_refusal(version, exc)

    def _outage_ended(self, version: str) -> None:
        """``version`` loaded: a store outage that held it up ends (logged with its length)."""
        outage = self._retries.ended(version)
        if outage is not None:
            log.info("worker %s loaded %s %s: the store answers again after %.1f s (%d failed tries)", self.hostname,
                     self.model, version, max(0.0, time.monotonic() - outage.since_s), outage.failures)

    def _record_refusal(self, version: str, exc: BaseException) -> None:
        """The refusal in the heartbeat (``last_refusal``) and in Redis (what ``fleet status`` shows)."""
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
        outage = OutageLog(log, "reconciler lost Redis")
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = subscriber.pubsub()
                    pubsub.subscribe(CHANGES_CHANNEL)
                    await_subscription(pubsub, CHANGES_CHANNEL, time.monotonic() + 5.0)  # then the read
                    self.sync()  # a change may have been published while we were not subscribed
                    outage.recovered(time.monotonic())
                deadline = time.monotonic() + self._wait_s()
                while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
                    message = pubsub.get_message(timeout=min(left, LISTEN_WAIT_S))
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
                outage.failed(exc, time.monotonic())
                _close(pubsub)
                pubsub = None
                self._stop.wait(RETRY_AFTER_ERROR_S)
            except Exception:  # never let the reconciler die: the worker would stop following changes
                log.exception("reconciler pass failed")
                self._stop.wait(RETRY_AFTER_ERROR_S)
        _close(pubsub)
        subscriber.close()


def _digest(state: ModelState | None, version: str | None) -> str | None:
    """The manifest digest the state recorded for ``version``, which its load must find (None: no check)."""
    return state.manifest_sha256_of(version) if state is not None else None


def _names(message: dict[str, Any], model: str) -> bool:
    if message.get("type") != "message":  # a subscribe confirmation carries a count
        return False
    data = message.get("data")
    return (data.decode() if isinstance(data, bytes) else str(data)) == model


def _close(pubsub: Any) -> None:
    if pubsub is not None:
        with contextlib.suppress(redis.RedisError):
            pubsub.close()
