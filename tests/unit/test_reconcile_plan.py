"""The reconciler's decision table (pure: no Redis, no ORT)."""

from __future__ import annotations

import pytest

from protocol.model_state import ModelState
from workers.reconcile_plan import Held, Retry, Steps, plan


def state(stable: str | None = None, canary: str | None = None, generation: int = 1) -> ModelState:
    return ModelState(model="m", stable=stable, canary=canary, canary_weight=10 if canary else 0,
                      generation=generation)


@pytest.mark.parametrize(
    ("desired", "configured", "held", "refused", "expected"),
    [
        # no state: serve the configuration
        (None, "v1", Held("v1", None), {}, Steps()),
        (None, None, Held(None, None), {}, Steps()),
        # a pin: load it; a rollback to no pin: back to the configured version (None = the configured file)
        (state("v2"), "v1", Held("v1", None), {}, Steps(load_stable=True, stable="v2")),
        (state(None, generation=3), "v1", Held("v2", None), {}, Steps(load_stable=True, stable="v1")),
        (None, None, Held("v2", None), {}, Steps(load_stable=True, stable=None)),
        # a canary: load it; dropped (rollback): drop it; replaced: load the new one
        (state(None, "v2"), "v1", Held("v1", None), {}, Steps(load_canary="v2")),
        (state(None), "v1", Held("v1", "v2"), {}, Steps(drop_canary=True)),
        # replaced: the old canary leaves the slot at once, then the new one is loaded
        (state(None, "v3"), "v1", Held("v1", "v2"), {}, Steps(drop_canary=True, load_canary="v3")),
        # replaced by a canary this worker refused: the old one must not keep serving the canary queue
        (state(None, "bad", generation=4), "v1", Held("v1", "v2"), {"bad": 4}, Steps(drop_canary=True)),
        (state("v1", "bad", generation=4), "v0", Held("v1", "v2"), {"bad": 4}, Steps(drop_canary=True)),
        # the same canary: kept
        (state(None, "v2"), "v1", Held("v1", "v2"), {}, Steps()),
        # a promotion reuses the canary's engine (and empties the canary slot)
        (state("v2"), "v1", Held("v1", "v2"), {}, Steps(promote_canary=True, drop_canary=True)),
        # promoted, then a new canary at once
        (state("v2", "v3"), "v1", Held("v1", "v2"), {}, Steps(promote_canary=True, drop_canary=True, load_canary="v3")),
        # a version refused at this generation is not tried again; at a later one it is
        (state("bad", generation=4), "v1", Held("v1", None), {"bad": 4}, Steps()),
        (state("bad", generation=5), "v1", Held("v1", None), {"bad": 4}, Steps(load_stable=True, stable="bad")),
        (state(None, "bad", generation=4), "v1", Held("v1", None), {"bad": 4}, Steps()),
    ],
)
def test_plan(
    desired: ModelState | None, configured: str | None, held: Held, refused: dict[str, int], expected: Steps
) -> None:
    steps = plan(desired, configured, held, refused)
    assert steps == expected
    assert steps.nothing == (expected == Steps())


@pytest.mark.parametrize(
    ("desired", "retries", "now_s", "expected"),
    [
        # the store did not answer: not tried again before its retry time, under the same generation
        (state("v2", generation=4), {"v2": Retry(4, 12.0)}, 11.9, Steps()),
        (state(None, "v2", generation=4), {"v2": Retry(4, 12.0)}, 11.9, Steps()),
        # its time has come: tried again, with no new pin
        (state("v2", generation=4), {"v2": Retry(4, 12.0)}, 12.0, Steps(load_stable=True, stable="v2")),
        (state(None, "v2", generation=4), {"v2": Retry(4, 12.0)}, 30.0, Steps(load_canary="v2")),
        # the state changed (pinned again, or another change): tried at once
        (state("v2", generation=5), {"v2": Retry(4, 12.0)}, 0.0, Steps(load_stable=True, stable="v2")),
        # a wait for another version holds nothing up
        (state("v2", "v3", generation=4), {"v3": Retry(4, 12.0)}, 0.0, Steps(load_stable=True, stable="v2")),
        # unpinned during the outage: back to the configured version at once
        (state(None, generation=5), {"v2": Retry(4, 12.0)}, 0.0, Steps()),
    ],
)
def test_plan_retries_a_version_the_store_could_not_deliver_once_its_time_has_come(
    desired: ModelState, retries: dict[str, Retry], now_s: float, expected: Steps
) -> None:
    assert plan(desired, "v1", Held("v1", None), {}, retries=retries, now_s=now_s) == expected


def test_a_verdict_outlasts_a_retry_time() -> None:
    """A version refused (a verdict) under this generation stays refused whatever its retry time says."""
    assert plan(state("v2", generation=4), "v1", Held("v1", None), {"v2": 4}, retries={"v2": Retry(4, 1.0)},
                now_s=99.0) == Steps()


@pytest.mark.parametrize(
    ("desired", "held", "expected"),
    [
        # a worker without a store holds its configured file (stable None), whose version is 1.0.0
        (state("1.0.0"), Held(None, None), Steps()),  # a pin of that version: nothing to load
        (state("2.0.0"), Held(None, None), Steps(load_stable=True, stable="2.0.0")),  # another: tried (refused)
        (state(None), Held("1.0.0", None), Steps()),  # unpinned after serving the pin: the same file
        (state(None, "1.0.0"), Held(None, None), Steps(load_canary="1.0.0")),  # a canary of it: loaded
    ],
)
def test_plan_without_a_store_treats_the_configured_files_version_as_the_configured_file(
    desired: ModelState, held: Held, expected: Steps
) -> None:
    assert plan(desired, None, held, {}, file_version="1.0.0") == expected
