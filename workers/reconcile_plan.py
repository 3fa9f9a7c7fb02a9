"""What a worker must do to match the desired state: a pure decision, no Redis, no ORT.

:func:`plan` takes the state read from Redis, the configured version and what the worker holds, and
returns the :class:`Steps` that :class:`workers.reconcile.Reconciler` then carries out (load, swap,
drop). Tested by a table in ``tests/unit/test_reconcile_plan.py``.

A held canary that the state no longer names is dropped at once, whether the state has no canary or
another one: a replaced canary must not keep serving the canary queue while its successor loads, nor
when its successor is refused (the canary queue then runs on stable, which every figure names).

Loads run beside the reconciler (:mod:`workers.reconcile`), so a step that needs none (dropping a canary,
promoting the held canary) is never held up by one in flight: :func:`to_start` picks the loads to begin
(at most one current per role, none of a version already loading), and :func:`landing_role` says where a
load that ended goes once the state may have moved on (its role, the other one, or nowhere: discarded);
a load for which it says nowhere while it runs is superseded (:mod:`workers.version_loads`).
Tested by tables in ``tests/unit/test_reconcile_plan.py`` and ``tests/unit/test_reconcile_loads.py``.

A version this worker could not load is skipped by :func:`plan` in two ways: refused (a verdict about the
version: not tried until the state's generation changes), or waiting for a :class:`Retry` (the store did not
answer: tried again once its time has come, or at once when the generation changes;
:mod:`workers.load_retry` says which failures those are and sets the times).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.model_state import ModelState

if TYPE_CHECKING:
    from workers.jobs import Role

__all__ = ["Held", "Retry", "Steps", "holds", "landing_role", "plan", "to_start"]


@dataclass(frozen=True)
class Held:
    """The versions a worker holds: ``stable`` as asked for (None = the configured one), ``canary``, and the
    manifest digest each was loaded under (None: loaded without one)."""

    stable: str | None
    canary: str | None
    stable_sha256: str | None = None
    canary_sha256: str | None = None


@dataclass(frozen=True)
class Retry:
    """A version whose load failed because the store did not answer: tried again from ``at_s`` (monotonic s),
    or at once once the state's generation is no longer ``generation``."""

    generation: int
    at_s: float


def holds(version: str | None, wanted_sha256: str | None, held: str | None, held_sha256: str | None) -> bool:
    """Whether the copy held (``held`` loaded under ``held_sha256``) is the one wanted: the same version and,
    when the state recorded a manifest digest for it, loaded under that digest. A version pinned again with
    another manifest (new bytes under the old name) is then loaded anew, not kept as the old bytes."""
    return version == held and (wanted_sha256 is None or wanted_sha256 == held_sha256)


def _sha256_of(state: ModelState | None, role: Role) -> str | None:
    """The manifest digest the state records for its ``role`` version (None for the configured one)."""
    if state is None:
        return None
    return state.stable_manifest_sha256 if role == "stable" else state.canary_manifest_sha256


@dataclass(frozen=True)
class Steps:
    """What to do, in this order: a new stable (load it, or promote the held canary), then the canary."""

    load_stable: bool = False
    stable: str | None = None
    """The stable version to load (None = the configured one); meaningful when ``load_stable``."""
    promote_canary: bool = False
    """The held canary's engine becomes stable (no reload); the canary slot is then dropped or reloaded."""
    load_canary: str | None = None
    drop_canary: bool = False
    """The held canary is not the desired one (none, or another): its engine leaves the canary slot before
    ``load_canary`` is tried, so canary-queue requests run on stable until a new canary is in."""

    @property
    def nothing(self) -> bool:
        """The worker already matches the state."""
        return not (self.load_stable or self.promote_canary or self.load_canary or self.drop_canary)

    @property
    def loads(self) -> tuple[tuple[Role, str | None], ...]:
        """The loads these steps need, (role, version), stable first."""
        stable: tuple[tuple[Role, str | None], ...] = (("stable", self.stable),) if self.load_stable else ()
        canary: tuple[tuple[Role, str | None], ...] = (("canary", self.load_canary),) if self.load_canary else ()
        return stable + canary


def wanted_stable(state: ModelState | None, configured: str | None) -> str | None:
    """The stable version in force: the pinned one, else the configured store version (None = the
    configured file)."""
    pinned = state.stable if state is not None else None
    return pinned or configured


def plan(
    state: ModelState | None, configured: str | None, held: Held, refused: Mapping[str, int], *,
    file_version: str | None = None, retries: Mapping[str, Retry] | None = None, now_s: float = 0.0,
) -> Steps:
    """The steps from ``held`` to ``state``.

    ``state`` None means no state in Redis (serve the configuration), not "Redis could not be read":
    callers skip the pass on a read error. ``refused`` maps a version to the state generation at which
    this worker refused it; such a version is not tried again until the generation changes.
    ``retries`` maps a version whose load failed transiently (the store did not answer) to its :class:`Retry`:
    it is not tried again before ``at_s`` (compared with ``now_s``, monotonic s) unless the generation changed.
    ``file_version``: the version label of the configured file, for a worker without a model store
    (None otherwise): a pin of that version is the configured file, which such a worker already holds.
    """
    generation = state.generation if state is not None else 0

    def refused_now(version: str | None) -> bool:
        if version is None:
            return False
        retry = (retries or {}).get(version)
        waiting = retry is not None and retry.generation == generation and now_s < retry.at_s
        return refused.get(version) == generation or waiting

    stable, stable_sha256 = wanted_stable(state, configured), _sha256_of(state, "stable")
    load_stable = promote = False
    canary_after = held.canary
    same_file = file_version is not None and {stable, held.stable} <= {None, file_version}
    if not holds(stable, stable_sha256, held.stable, held.stable_sha256) and not same_file and not refused_now(stable):
        if stable is not None and holds(stable, stable_sha256, held.canary, held.canary_sha256):
            promote, canary_after = True, None
        else:
            load_stable = True
    wanted_canary, canary_sha256 = (state.canary if state is not None else None), _sha256_of(state, "canary")
    drop = held.canary is not None and not holds(wanted_canary, canary_sha256, held.canary, held.canary_sha256)
    kept = canary_after is not None and not drop
    load_canary = None
    if wanted_canary is not None and not kept and not refused_now(wanted_canary):
        load_canary = wanted_canary
    return Steps(load_stable=load_stable, stable=stable if load_stable else None, promote_canary=promote,
                 load_canary=load_canary, drop_canary=drop)


def to_start(steps: Steps, loading: Mapping[Role, str | None]) -> list[tuple[Role, str | None]]:
    """The loads of ``steps`` to begin now, given the current loads in flight (``loading``: role -> version).

    At most one current load per role: a load whose role is busy waits for the pass that runs when the busy
    one ends (it lands elsewhere when the state moved on: a canary promoted during its load). A load the
    state no longer names is not current: it was superseded and abandoned (:mod:`workers.version_loads`,
    which bounds those to one per role), so its replacement does not wait for it. A version already
    loading, in either role, is not loaded twice: it lands where the state wants it (:func:`landing_role`).
    """
    return [(role, version) for role, version in steps.loads
            if role not in loading and version not in loading.values()]


def landing_role(
    state: ModelState | None, configured: str | None, version: str | None, loaded_as: Role, held: Held,
    manifest_sha256: str | None = None,
) -> Role | None:
    """Where ``version``, just loaded as ``loaded_as`` under ``manifest_sha256``, goes under ``state`` (read
    after the load): the role it was loaded for when the state still names it there, else the other role when
    the state names it there (a canary promoted, or a pin made the canary, during its load: no reload), else
    None (discarded unserved). The state names it only with the digest it was loaded under (when the state
    records one: a pin again with a new manifest supersedes a load under the old). A role that already holds
    ``version`` under that digest does not take it twice."""
    other: Role = "canary" if loaded_as == "stable" else "stable"
    for role in (loaded_as, other):
        if role == "stable":
            named = wanted_stable(state, configured) == version
            held_now = held.stable == version and held.stable_sha256 == manifest_sha256
        else:
            named = version is not None and state is not None and state.canary == version
            held_now = held.canary == version and held.canary_sha256 == manifest_sha256
        if named and holds(version, _sha256_of(state, role), version, manifest_sha256) and not held_now:
            return role
    return None
