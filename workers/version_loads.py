"""The loads a reconciler has in flight: per role, the current one and at most one abandoned.

A load (:func:`workers.engines.load_version`) runs on a thread of its own (:mod:`workers.reconcile`) and
cannot be interrupted inside a step: a fetch blocked in a socket read of a hung store ends only when the
store answers or the read times out (:mod:`store.s3`: 60 s a read, retried; a download that receives no byte
for ``store.fetch_stall_timeout_s``, 240 s, ends in a StoreError). So when the
desired state stops naming a loading version, the reconciler **marks** the load superseded
(:attr:`VersionLoad.stop`); the load checks the mark between its steps (after each file fetched, after
the fetch, the session, the warm-up) and ends early, dropping what it built. A marked load that cannot
stop at once is **abandoned** (:meth:`VersionLoads.abandon`): it keeps its thread until its step ends,
its role is free for the replacement, and whatever it brings back is discarded, never swapped in.

The bound: at most one current and one abandoned load per role. A further change while both run (the
role's current load superseded too, its abandoned slot taken) waits until one of them ends
(:meth:`VersionLoads.waits`; the reconciler logs it once), so a store that hangs pins at most two
threads per role, never a pile of them.

Memory: a worker holds at most six engines (ONNX Runtime sessions, each about its model's file size in
memory, more with the KV cache): stable and canary serving, and per role one current and one abandoned
load. An abandoned load holds its engine only until its next step (the session or the warm-up ends), and
none when it stopped during the fetch; in steady state (no load in flight) a worker holds two.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from store.fetch import Stopped

if TYPE_CHECKING:
    from workers.jobs import Role

__all__ = ["VersionLoad", "VersionLoads"]

log = logging.getLogger("fleet.reconcile")


@dataclass(eq=False)
class VersionLoad:
    """One load in flight: ``version`` (None = the configured one) for ``role``."""

    role: Role
    version: str | None
    manifest_sha256: str | None = None
    """The manifest digest the state recorded for ``version`` when the load began (None: no check)."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set when the state no longer names ``version`` (for either role): the load stops at its next step."""

    @property
    def superseded(self) -> bool:
        """The load was marked: it is discarded when it ends, whatever it brings back."""
        return self.stop.is_set()

    @property
    def label(self) -> str:
        """The version as the log names it."""
        return self.version or "configured"


class VersionLoads:
    """The loads in flight by role, and the log lines about them (``who``: "worker <hostname>", ``model``).
    Not thread-safe: the reconciler calls it under its lock."""

    def __init__(self, who: str, model: str) -> None:
        self.who = who
        self.model = model
        self.current: dict[Role, VersionLoad] = {}
        """Role -> the load whose result the role may take (or a superseded one that could not be abandoned)."""
        self.abandoned: dict[Role, VersionLoad] = {}
        """Role -> a superseded load still running, whose result is discarded; at most one per role."""
        self._waits_logged: set[tuple[Role, str | None, int]] = set()
        """(role, version, generation) of the loads already logged as waiting."""

    def versions(self) -> dict[Role, str | None]:
        """Role -> the version of its current load (what :func:`workers.reconcile_plan.to_start` takes)."""
        return {role: load.version for role, load in self.current.items()}

    def begin(self, role: Role, version: str | None, manifest_sha256: str | None = None) -> VersionLoad:
        """Record a new current load of ``version`` (held to ``manifest_sha256``, when given) for ``role``.

        Raises:
            RuntimeError: ``role`` has a current load (abandon it first, :meth:`supersede`).
        """
        if role in self.current:
            raise RuntimeError(f"a {role} load of {self.current[role].label} is in flight already")
        load = VersionLoad(role, version, manifest_sha256)
        self.current[role] = load
        if role in self.abandoned:
            log.info("%s loads %s %s as %s beside its abandoned load of %s", self.who, self.model, load.label, role,
                     self.abandoned[role].label)
        return load

    def supersede(self, named: Callable[[Role, str | None], bool], generation: int) -> None:
        """Mark each current load whose (role, version) the state no longer names (``named`` False): it stops
        at its next step. Then move each marked one whose role's abandoned slot is free to that slot
        (:meth:`abandon`): its role is free for a new load. ``generation``: the state's, for the log."""
        for role, load in list(self.current.items()):
            if not load.superseded and not named(role, load.version):
                load.stop.set()
                log.info("%s marks its load of %s %s as %s superseded (the state, generation %d, no longer names "
                         "it): it stops at its next step", self.who, self.model, load.label, role, generation)
            if self.abandon(role) is not None:
                log.info("%s abandons its load of %s %s as %s: the next %s load does not wait for it, and what it "
                         "brings back is discarded", self.who, self.model, load.label, role, role)

    def abandon(self, role: Role) -> VersionLoad | None:
        """Move ``role``'s current load, when it is superseded and the role's abandoned slot is free, to that
        slot (its role is then free for a new load); returns the load moved, else None."""
        load = self.current.get(role)
        if load is None or not load.superseded or role in self.abandoned:
            return None
        self.abandoned[role] = self.current.pop(role)
        return load

    def waits(self, role: Role) -> VersionLoad | None:
        """The abandoned load a new load for ``role`` waits for: both the role's slots hold superseded loads."""
        load = self.current.get(role)
        if load is not None and load.superseded:
            return self.abandoned.get(role)
        return None

    def log_waits(self, loads: Iterable[tuple[Role, str | None]], generation: int) -> None:
        """Say (once per state generation) that each of ``loads`` (role, version) whose role is held by two
        superseded loads waits until one of them ends."""
        for role, version in loads:
            older, key = self.waits(role), (role, version, generation)
            if older is None or key in self._waits_logged:
                continue
            self._waits_logged.add(key)
            log.warning("%s waits to load %s %s as %s: its superseded loads of %s and %s still run (at most one "
                        "abandoned load per role); it starts when one of them ends", self.who, self.model,
                        version or "configured", role, older.label, self.current[role].label)

    def end(self, load: VersionLoad) -> None:
        """Forget ``load`` (current or abandoned), which ended."""
        for slots in (self.current, self.abandoned):
            if slots.get(load.role) is load:
                del slots[load.role]
        if not self.abandoned:
            self._waits_logged.clear()  # nothing waits any more

    def discarded(self, load: VersionLoad, failure: Exception | None) -> None:
        """Log the end of the superseded ``load``: stopped at a step (:class:`store.fetch.Stopped`), failed
        (not a refusal: the state no longer names the version), or loaded; what it built is dropped unserved."""
        what = f"{self.who} discards {self.model} {load.label}"
        if isinstance(failure, Stopped):
            log.info("%s: its load as %s stopped as superseded after %s", what, load.role, failure.step)
        elif failure is not None:
            log.warning("%s: its load as %s, superseded, failed (not recorded as a refusal): %s: %s", what,
                        load.role, type(failure).__name__, failure)
        else:
            log.info("%s, loaded as %s: superseded during its load", what, load.role)

    def stop_all(self) -> None:
        """Mark every load in flight (the worker stops): each ends at its next step."""
        for load in (*self.current.values(), *self.abandoned.values()):
            load.stop.set()
