"""What a worker must do to match the desired state: a pure decision, no Redis, no ORT.

:func:`plan` takes the state read from Redis, the configured version and what the worker holds, and
returns the :class:`Steps` that :class:`workers.reconcile.Reconciler` then carries out (load, swap,
drop). Tested by a table in ``tests/unit/test_reconcile_plan.py``.

A held canary that the state no longer names is dropped at once, whether the state has no canary or
another one: a replaced canary must not keep serving the canary queue while its successor loads, nor
when its successor is refused (the canary queue then runs on stable, which every figure names).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from protocol.model_state import ModelState

__all__ = ["Held", "Steps", "plan"]


@dataclass(frozen=True)
class Held:
    """The versions a worker holds: ``stable`` as asked for (None = the configured one), ``canary``."""

    stable: str | None
    canary: str | None


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


def wanted_stable(state: ModelState | None, configured: str | None) -> str | None:
    """The stable version in force: the pinned one, else the configured store version (None = the
    configured file)."""
    pinned = state.stable if state is not None else None
    return pinned or configured


def plan(
    state: ModelState | None, configured: str | None, held: Held, refused: Mapping[str, int], *,
    file_version: str | None = None,
) -> Steps:
    """The steps from ``held`` to ``state``.

    ``state`` None means no state in Redis (serve the configuration), not "Redis could not be read":
    callers skip the pass on a read error. ``refused`` maps a version to the state generation at which
    this worker refused it; such a version is not tried again until the generation changes.
    ``file_version``: the version label of the configured file, for a worker without a model store
    (None otherwise): a pin of that version is the configured file, which such a worker already holds.
    """
    generation = state.generation if state is not None else 0

    def refused_now(version: str | None) -> bool:
        return version is not None and refused.get(version) == generation

    stable = wanted_stable(state, configured)
    load_stable = promote = False
    canary_after = held.canary
    same_file = file_version is not None and {stable, held.stable} <= {None, file_version}
    if stable != held.stable and not same_file and not refused_now(stable):
        if stable is not None and stable == held.canary:
            promote, canary_after = True, None
        else:
            load_stable = True
    wanted_canary = state.canary if state is not None else None
    drop = held.canary is not None and held.canary != wanted_canary
    load_canary = None
    if wanted_canary is not None and wanted_canary != canary_after and not refused_now(wanted_canary):
        load_canary = wanted_canary
    return Steps(load_stable=load_stable, stable=stable if load_stable else None, promote_canary=promote,
                 load_canary=load_canary, drop_canary=drop)
