"""The manifest digest a pin or canary records (pure: no Redis, no store): the record schema, old records
without it, the rollback stack that keeps it, and the reconciler's decisions that honour it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from protocol.model_state import HistoryEntry, ModelState, Split
from protocol.model_undo import UndoStack, next_undo, undo_of_history
from workers.reconcile_plan import Held, Steps, landing_role, plan

A, B, C = "a" * 64, "b" * 64, "c" * 64


def state(stable: str | None = None, canary: str | None = None, stable_sha: str | None = None,
          canary_sha: str | None = None, generation: int = 1) -> ModelState:
    return ModelState(model="m", stable=stable, canary=canary, canary_weight=10 if canary else 0,
                      stable_manifest_sha256=stable_sha, canary_manifest_sha256=canary_sha, generation=generation)


def test_a_record_written_before_digests_parses_with_none() -> None:
    old = ModelState.model_validate_json(
        '{"model": "m", "stable": "1.0.0", "canary": "1.1.0", "canary_weight": 10, "generation": 3,'
        ' "changed_by": "x", "changed_at_unix_s": 1.0}'
    )
    assert (old.stable_manifest_sha256, old.canary_manifest_sha256) == (None, None)
    assert old.manifest_sha256_of("1.0.0") is None
    entry = HistoryEntry.model_validate_json(
        '{"at_unix_s": 1.0, "by": "x", "action": "pin", "from": {"stable": null}, "to": {"stable": "1.0.0"}}'
    )
    assert entry.to.stable_manifest_sha256 is None
    stack = UndoStack.model_validate_json('{"versions": ["1.0.0", null]}')
    assert stack.manifest_sha256s == () and stack.manifest_sha256_at(-1) is None


def test_the_digests_round_trip_and_name_their_version() -> None:
    s = state("1.0.0", "1.1.0", A, B)
    again = ModelState.model_validate_json(s.model_dump_json())
    assert again == s and again.split().stable_manifest_sha256 == A and again.split().canary_manifest_sha256 == B
    assert (s.manifest_sha256_of("1.0.0"), s.manifest_sha256_of("1.1.0"), s.manifest_sha256_of("9")) == (A, B, None)
    assert s.manifest_sha256_of(None) is None


@pytest.mark.parametrize("bad", ["ABC", "a" * 63, "A" * 64, "g" * 64])
def test_a_malformed_digest_is_refused_naming_the_field(bad: str) -> None:
    with pytest.raises(ValidationError, match="stable_manifest_sha256") as caught:
        Split(stable="1.0.0", stable_manifest_sha256=bad)
    assert "64 lower-case hex digits" in str(caught.value)


def test_the_rollback_stack_keeps_each_pins_digest() -> None:
    stack = UndoStack(versions=("0.9.0",))  # stored before digests were kept
    stack = next_undo(stack, "pin", Split(stable="1.0.0", stable_manifest_sha256=A), Split(stable="2.0.0"))
    stack = next_undo(stack, "promote", Split(stable="2.0.0", stable_manifest_sha256=B), Split(stable="3.0.0"))
    assert stack.versions == ("0.9.0", "1.0.0", "2.0.0") and stack.manifest_sha256s == (A, B)
    assert [stack.manifest_sha256_at(i) for i in (0, 1, 2, -1)] == [None, A, B, B]
    stack = next_undo(stack, "rollback", Split(stable="3.0.0"), Split(stable="2.0.0"))
    assert stack.versions == ("0.9.0", "1.0.0") and stack.manifest_sha256_at(-1) == A
    stack = next_undo(stack, "rollback", Split(stable="2.0.0"), Split(stable="1.0.0"))
    assert stack.versions == ("0.9.0",) and stack.manifest_sha256_at(-1) is None
    entries = [HistoryEntry.model_validate({"at_unix_s": 1.0, "by": "x", "action": "pin",
                                            "from": Split(stable="1.0.0", stable_manifest_sha256=C),
                                            "to": Split(stable="2.0.0")})]
    assert undo_of_history(entries, may_be_trimmed=False).manifest_sha256_at(-1) == C


@pytest.mark.parametrize(
    ("desired", "held", "expected"),
    [
        # pinned again with another manifest: the held copy of that name is other bytes, loaded anew
        (state("v1", stable_sha=B, generation=2), Held("v1", None, A), Steps(load_stable=True, stable="v1")),
        (state("v1", stable_sha=A), Held("v1", None, A), Steps()),
        # loaded before digests were recorded, now pinned with one: loaded again under it
        (state("v1", stable_sha=A), Held("v1", None, None), Steps(load_stable=True, stable="v1")),
        # an old record (no digest): whatever is held under the name is kept
        (state("v1"), Held("v1", None, A), Steps()),
        # the canary re-canaried with a new manifest: the old bytes leave the slot, the new are loaded
        (state("v1", "v2", A, C), Held("v1", "v2", A, B), Steps(drop_canary=True, load_canary="v2")),
        (state("v1", "v2", A, B), Held("v1", "v2", A, B), Steps()),
        # promoted: the held canary becomes stable only when it holds the promoted manifest
        (state("v2", stable_sha=B), Held("v1", "v2", A, B), Steps(promote_canary=True, drop_canary=True)),
        (state("v2", stable_sha=C), Held("v1", "v2", A, B),
         Steps(load_stable=True, stable="v2", drop_canary=True)),
        # refused under this generation: not retried until the state changes
        (state("v1", stable_sha=B, generation=4), Held("v0", None), Steps()),
    ],
)
def test_plan_honours_the_recorded_digest(desired: ModelState, held: Held, expected: Steps) -> None:
    assert plan(desired, "v0", held, {"v1": 4}) == expected


@pytest.mark.parametrize(
    ("now", "loaded_sha", "held", "expected"),
    [
        (state("v1", stable_sha=A), A, Held("v0", None), "stable"),
        (state("v1", stable_sha=B), A, Held("v0", None), None),  # pinned again during the load: discarded
        (state("v1"), A, Held("v0", None), "stable"),  # an old record names any manifest
        (state("v1", stable_sha=B), B, Held("v1", None, A), "stable"),  # new bytes replace the held old ones
        (state("v1", stable_sha=A), A, Held("v1", None, A), None),  # already held
        (state("v0", "v1", canary_sha=A), A, Held("v0", None), "canary"),
        (state("v0", "v1", canary_sha=B), A, Held("v0", None), None),
    ],
)
def test_landing_role_honours_the_recorded_digest(
    now: ModelState, loaded_sha: str, held: Held, expected: str | None
) -> None:
    assert landing_role(now, "v0", "v1", "stable", held, loaded_sha) == expected
