"""Which loads a reconciler pass begins while others are in flight, and where a finished load lands (pure)."""

from __future__ import annotations

import pytest

from protocol.model_state import ModelState
from workers.jobs import Role
from workers.reconcile_plan import Held, Steps, landing_role, to_start


def state(stable: str | None = None, canary: str | None = None, generation: int = 1) -> ModelState:
    return ModelState(model="m", stable=stable, canary=canary, canary_weight=10 if canary else 0,
                      generation=generation)


@pytest.mark.parametrize(
    ("steps", "loading", "expected"),
    [
        # nothing in flight: every load the steps need, stable first
        (Steps(load_stable=True, stable="v2", load_canary="v3"), {}, [("stable", "v2"), ("canary", "v3")]),
        (Steps(load_stable=True, stable=None), {}, [("stable", None)]),
        # a canary load in flight never holds up a stable load (a pin rolled back to an unloaded version)
        (Steps(load_stable=True, stable="v1"), {"canary": "c9"}, [("stable", "v1")]),
        # nor a stable load a canary load
        (Steps(load_canary="v3"), {"stable": "v2"}, [("canary", "v3")]),
        # one load per role: the next waits for the pass that runs when the busy one ends
        (Steps(load_stable=True, stable="v4"), {"stable": "v2"}, []),
        (Steps(load_canary="v5"), {"canary": "v3"}, []),
        # the same version already loading (in either role) is not loaded twice
        (Steps(load_stable=True, stable="v2"), {"stable": "v2"}, []),
        (Steps(load_stable=True, stable="v3"), {"canary": "v3"}, []),  # promoted during its load
        (Steps(load_canary="v2"), {"stable": "v2"}, []),
        # steps that need no load begin none
        (Steps(drop_canary=True), {"stable": "v2"}, []),
        (Steps(promote_canary=True, drop_canary=True), {}, []),
    ],
)
def test_to_start(steps: Steps, loading: dict[Role, str | None], expected: list[tuple[Role, str | None]]) -> None:
    assert to_start(steps, loading) == expected


@pytest.mark.parametrize(
    ("now", "configured", "version", "loaded_as", "held", "expected"),
    [
        # still named where it was loaded for: swapped in there
        (state("v2"), "v1", "v2", "stable", Held("v1", None), "stable"),
        (state(None, "v3"), "v1", "v3", "canary", Held("v1", None), "canary"),
        (state(None), None, None, "stable", Held("v2", None), "stable"),  # back to the configured file
        # rolled back during its load: discarded
        (state(None), "v1", "v2", "stable", Held("v1", None), None),
        (state(None), "v1", "v3", "canary", Held("v1", None), None),
        (None, "v1", "v3", "canary", Held("v1", None), None),
        # replaced during its load
        (state("v4"), "v1", "v2", "stable", Held("v1", None), None),
        (state(None, "v4"), "v1", "v3", "canary", Held("v1", None), None),
        # the canary was promoted (or pinned) during its load: it becomes stable, no reload
        (state("v3"), "v1", "v3", "canary", Held("v1", None), "stable"),
        # a pin rolled back and the same version made the canary during its load
        (state(None, "v2"), "v1", "v2", "stable", Held("v1", None), "canary"),
        # a role that already holds it does not take it twice
        (state("v3"), "v1", "v3", "stable", Held("v3", None), None),
        (state("v1", "v3"), "v1", "v3", "canary", Held("v1", "v3"), None),
    ],
)
def test_landing_role(
    now: ModelState | None, configured: str | None, version: str | None, loaded_as: Role, held: Held,
    expected: Role | None,
) -> None:
    assert landing_role(now, configured, version, loaded_as, held) == expected
