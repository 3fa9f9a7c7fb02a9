"""The automatic canary rollback: :func:`guard_canary` judges a model's canary over its window
(:mod:`protocol.canary_verdict`) and rolls it back when it broke its bounds (``models.<m>.canary``).
"""

from __future__ import annotations

import redis

from protocol.canary_verdict import Verdict, canary_verdict, unserved_canary_verdict
from protocol.errors import StateChangeRefused
from protocol.model_changes import rollback
from protocol.model_records import AUTO_ROLLBACKS_KEY, GUARD_LOCK_KEY, GUARD_TURN_KEY, read_state
from protocol.model_reports import read_outcomes, refusals
from protocol.settings import FleetSettings

__all__ = ["GUARD_LOCK_MS", "guard_canary"]

GUARD_LOCK_MS = 5_000
"""How long one caller holds the right to roll a judged canary back (ms)."""


def guard_canary(
    r: redis.Redis[bytes], settings: FleetSettings, model: str, *, one_caller_per_s: float | None = None
) -> Verdict | None:
    """Judge the model's canary over its window; roll it back (``by="auto-rollback"``) when it broke
    its bounds. None when the model has no canary. Concurrent callers roll back at most once (a short
    SET NX lock, and the rollback only applies to the generation that was judged).

    ``one_caller_per_s`` (seconds; the workers pass ``canary.check_interval_s``): at most one caller
    fleet-wide judges per that period (a SET NX PX turn), so N workers read the outcome window (up to
    the stream's 20,000 entries) once per period instead of N times. Returns None when another caller
    has the turn.
    """
    state = read_state(r, model)
    if state is None or state.canary is None:
        return None
    if one_caller_per_s is not None and not r.set(
        GUARD_TURN_KEY.format(model=model), "1", nx=True, px=max(1, int(one_caller_per_s * 1000))
    ):
        return None
    bounds = settings.model(model).canary
    samples = read_outcomes(r, model, bounds.window_s, since_unix_s=state.changed_at_unix_s)
    verdict = canary_verdict(samples, bounds, canary=state.canary, stable=state.stable)
    refused = [(x.worker, f"{x.error_type}: {x.error}") for x in refusals(r, model)
               if x.version == state.canary and x.at_unix_s >= state.changed_at_unix_s]
    verdict = unserved_canary_verdict(verdict, samples, state.canary, refused, bounds.min_requests)
    if not verdict.rollback:
        return verdict
    if not r.set(GUARD_LOCK_KEY.format(model=model), "1", nx=True, px=GUARD_LOCK_MS):
        return verdict
    try:
        rollback(r, model, "auto-rollback", reason=verdict.reason, figures=verdict.figures(), auto=True,
                 expect_generation=state.generation)
    except StateChangeRefused:
        return verdict  # someone else changed the state first: nothing to roll back here
    r.incr(AUTO_ROLLBACKS_KEY.format(model=model))
    return verdict

