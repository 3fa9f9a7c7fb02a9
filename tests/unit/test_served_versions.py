"""Desired versus served (pure: no Redis): the fallback a starting worker takes, what ``fleet status`` and
``fleet models pin`` say when the desired version is not the one served, and superseded refusals."""

from __future__ import annotations

from typing import Any

import pytest

from producer.model_status import not_served, served_by, settled, superseded_by
from protocol.model_served import Served, last_served
from protocol.model_state import ModelState, Refusal

CHANGED_AT = 1000.0


def state(stable: str | None = None, canary: str | None = None) -> ModelState:
    return ModelState(model="m", stable=stable, canary=canary, canary_weight=10 if canary else 0, generation=3,
                      changed_at_unix_s=CHANGED_AT)


def beat(host: str, version: str, canary: str | None = None, model: str = "m") -> dict[str, Any]:
    return {"hostname": host, "model": model, "version": version, "canary_version": canary}


def refusal(worker: str, version: str, at: float = CHANGED_AT + 1) -> Refusal:
    return Refusal(worker=worker, version=version, error="sha256 is 11, the manifest says 22",
                   error_type="ChecksumMismatch", at_unix_s=at)


def served(store_version: str | None, worker: str = "w1") -> Served:
    return Served(worker=worker, version=store_version or "file", store_version=store_version, generation=1,
                  at_unix_s=1.0)


@pytest.mark.parametrize(
    ("entries", "refused", "expected"),
    [
        ([], "v3", None),
        ([served("v2"), served("v1")], "v3", "v2"),  # newest first
        ([served("v3"), served("v2")], "v3", "v2"),  # a worker that served the refused version does not count
        ([served(None)], "v3", None),  # the configured model was the last served
    ],
)
def test_last_served_skips_the_refused_version(entries: list[Served], refused: str, expected: str | None) -> None:
    entry = last_served(entries, other_than=(refused,))
    assert (entry.store_version if entry is not None else None) == expected


def test_served_by_groups_the_models_workers_by_stable_version() -> None:
    workers = [beat("w2", "v2"), beat("w1", "v2"), beat("w3", "v1"), beat("x1", "v9", model="other")]
    assert served_by(workers, "m") == {"v1": ["w3"], "v2": ["w1", "w2"]}


@pytest.mark.parametrize(
    ("desired", "configured", "workers", "refused", "expected"),
    [
        (state("v2"), "v1", [beat("w1", "v2"), beat("w2", "v2")], [], None),
        (None, "v1", [beat("w1", "v1")], [], None),
        (None, None, [beat("w1", "card-1.0")], [], None),  # a model file: its label is not compared
        (None, "v1", [], [], None),  # nothing asked beyond the config; readiness reports "no worker"
        (state("v2"), "v1", [], [], "no live worker serves m"),
        (state("v3"), "v1", [beat("w1", "v2"), beat("w2", "v2")], [refusal("w1", "v3"), refusal("w2", "v3")],
         "desired stable v3 is not served by any worker: w1, w2 serve v2; refused by w1 (ChecksumMismatch), "
         "w2 (ChecksumMismatch)"),
        (state("v3"), "v1", [beat("w1", "v3"), beat("w2", "v1")], [],
         "desired stable v3 is not served by every worker: w2 serves v1"),
        # a refusal from before the last change is not this change's
        (state("v3"), "v1", [beat("w1", "v2")], [refusal("w1", "v3", at=CHANGED_AT - 5)],
         "desired stable v3 is not served by any worker: w1 serves v2"),
        (state("v2", "v4"), "v1", [beat("w1", "v2", "v4"), beat("w2", "v2")], [refusal("w2", "v4")],
         "canary v4 is not loaded by w2 (their canary queue runs on stable v2); refused by w2 (ChecksumMismatch)"),
        # a replaced canary a worker still holds is named, not "stable"
        (state("v2", "v5"), "v1", [beat("w1", "v2", "v4"), beat("w2", "v2", "v4")], [refusal("w1", "v5")],
         "canary v5 is not loaded by w1, w2 (their canary queue runs on v4 (a canary the state no longer names)); "
         "refused by w1 (ChecksumMismatch)"),
        (state("v2", "v5"), "v1", [beat("w1", "v2", "v4"), beat("w2", "v2")], [],
         "canary v5 is not loaded by w1, w2 (the canary queue runs on stable v2 at w2; v4 (a canary the state "
         "no longer names) at w1)"),
    ],
)
def test_not_served_says_who_serves_what_instead(
    desired: ModelState | None, configured: str | None, workers: list[dict[str, Any]], refused: list[Refusal],
    expected: str | None,
) -> None:
    assert not_served("m", desired, configured, workers, refused) == expected


@pytest.mark.parametrize(
    ("desired", "workers", "refused", "expected"),
    [
        (None, [beat("w1", "v1")], [], True),
        (state("v2"), [beat("w1", "v2"), beat("w2", "v1")], [], False),  # w2 has not switched yet
        (state("v2"), [beat("w1", "v2"), beat("w2", "v1")], [refusal("w2", "v2")], True),  # w2 refused it
        (state("v2"), [beat("w1", "v2"), beat("w2", "v1")], [refusal("w2", "v2", at=CHANGED_AT - 1)], False),
        (state("v2", "v4"), [beat("w1", "v2")], [], False),  # the canary is not loaded yet
        (state("v2", "v4"), [beat("w1", "v2", "v4"), beat("x", "v0", model="other")], [], True),
    ],
)
def test_settled_when_every_worker_served_or_refused(
    desired: ModelState | None, workers: list[dict[str, Any]], refused: list[Refusal], expected: bool
) -> None:
    assert settled(desired, "v1", workers, refused) is expected


@pytest.mark.parametrize(
    ("desired", "workers", "expected"),
    [
        (state("v3"), [beat("w1", "v2")], None),  # still pinned, still refused: it stands
        (state("v2"), [beat("w1", "v2")], "the desired state is now v2"),
        (state(None), [beat("w1", "v1")], "the desired state is now v1"),
        (state("v2", "v5"), [], "the desired state is now v2 + canary v5"),
        (state("v3"), [beat("w1", "v3")], "w1 now serves v3"),  # a later try succeeded
    ],
)
def test_a_refusal_is_superseded_once_the_state_or_its_worker_moved_on(
    desired: ModelState, workers: list[dict[str, Any]], expected: str | None
) -> None:
    assert superseded_by(refusal("w1", "v3"), desired, "v1", workers) == expected


@pytest.mark.parametrize(
    ("served", "wait_s", "expected"),
    [
        ({"v2": ["w1", "w2"]}, 10.0, 0),  # served
        ({"v2": ["w1"], "v1": ["w2"]}, 10.0, 0),  # served by some (NOT SERVED names the others on stderr)
        ({"v1": ["w1", "w2"]}, 10.0, 1),  # by none: refused everywhere, or not switched within --wait-s
        ({"v1": ["w1"]}, 0.0, 0),  # not waited for
        ({}, 10.0, 0),  # no live worker: one that starts reads the pin
    ],
)
def test_pin_exits_1_when_it_waited_and_no_live_worker_serves_the_version(
    served: dict[str, list[str]], wait_s: float, expected: int
) -> None:
    from producer.lifecycle_cli import pin_exit_code

    assert pin_exit_code({"served": served, "not_served": None if expected == 0 else "…"}, "v2", wait_s) == expected
