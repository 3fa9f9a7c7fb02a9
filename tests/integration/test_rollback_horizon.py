"""Rollback walks back through every pin and promote, however many changes came since (real redis-server).

The history keeps the last ``HISTORY_KEEP`` (1,000) changes. Before, rollback rebuilt its stack of earlier
stable versions from that history: once canary traffic had pushed a pin out of it, ``rollback`` was refused
("no pin or promote to undo") while the version before the pin was still owed. The stack now lives in its
own key, written in the same transaction as each change; its own cap (``UNDO_KEEP``) is named when reached.
"""

from __future__ import annotations

import threading

import pytest
import redis

from protocol import model_changes, model_undo
from protocol.errors import StateChangeRefused
from protocol.model_state import HISTORY_KEEP, history, pin, promote, read_state, rollback, set_canary
from protocol.model_undo import UNDO_KEY, read_undo, undo_of_history
from tools.redis_server import EmbeddedRedis


@pytest.fixture
def r(redis_server: EmbeddedRedis) -> redis.Redis[bytes]:
    return redis_server.client()


def _stable(r: redis.Redis[bytes], model: str) -> str | None:
    state = read_state(r, model)
    assert state is not None
    return state.stable


def _canary_churn(r: redis.Redis[bytes], model: str, cycles: int) -> None:
    """A canary set and dropped ``cycles`` times: two history entries each, the stable version unchanged."""
    for i in range(cycles):
        set_canary(r, model, f"canary-{i}", 10, "ci@h")
        rollback(r, model, "ci@h", reason="canary dropped")


def test_rollback_finds_the_versions_pinned_before_the_history_horizon(r: redis.Redis[bytes]) -> None:
    pin(r, "m", "1.0.0", "ann@h")
    pin(r, "m", "2.0.0", "ann@h")
    _canary_churn(r, "m", HISTORY_KEEP // 2)
    entries = history(r, "m")
    assert len(entries) == HISTORY_KEEP and all(e.action in ("canary", "rollback") for e in entries)  # pins gone

    rollback(r, "m", "bob@h", reason="2.0.0 regressed")  # before: StateChangeRefused, nothing to undo
    assert _stable(r, "m") == "1.0.0"
    rollback(r, "m", "bob@h")
    assert _stable(r, "m") is None  # the configured version, as before the first pin
    with pytest.raises(StateChangeRefused) as refused:
        rollback(r, "m", "bob@h")
    assert refused.value.field == "canary" and "no pin or promote to undo" in refused.value.message


def test_a_promote_pushed_out_of_a_small_history_is_still_undone(
    r: redis.Redis[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with the history's cap lowered to 4 entries."""
    monkeypatch.setattr(model_changes, "HISTORY_KEEP", 4)
    pin(r, "m", "1.0.0", "ann@h")
    set_canary(r, "m", "1.1.0", 20, "ann@h")
    promote(r, "m", "ann@h")
    _canary_churn(r, "m", 2)
    assert [e.action for e in history(r, "m")] == ["canary", "rollback", "canary", "rollback"]
    rollback(r, "m", "bob@h")  # before: refused
    assert _stable(r, "m") == "1.0.0"


def test_the_stack_keeps_undo_keep_versions_and_names_that_limit(
    r: redis.Redis[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_undo, "UNDO_KEEP", 3)
    for v in ("1", "2", "3", "4", "5"):
        pin(r, "m", v, "ann@h")
    assert [rollback(r, "m", "bob@h").to.stable for _ in range(3)] == ["4", "3", "2"]
    with pytest.raises(StateChangeRefused) as refused:
        rollback(r, "m", "bob@h")
    assert (refused.value.field, refused.value.limit) == ("rollback", 3)
    assert "(the last 3)" in refused.value.message and "2 older ones were not kept" in refused.value.message
    assert "fleet models pin m VERSION" in refused.value.message and _stable(r, "m") == "2"


def test_a_model_changed_before_the_stack_existed_starts_from_its_history(
    r: redis.Redis[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No stack stored (the last change made by an older fleet): its history gives it, as before; one whose
    history may have been trimmed says so when it runs out."""
    for v in ("a", "b", "c"):
        pin(r, "m", v, "ann@h")
    r.delete(UNDO_KEY.format(model="m"))
    assert rollback(r, "m", "bob@h").to.stable == "b"
    assert rollback(r, "m", "bob@h").to.stable == "a"

    monkeypatch.setattr(model_changes, "HISTORY_KEEP", 4)
    pin(r, "t", "1", "ann@h")
    _canary_churn(r, "t", 2)
    r.delete(UNDO_KEY.format(model="t"))
    with pytest.raises(StateChangeRefused) as refused:
        rollback(r, "t", "bob@h")
    assert (refused.value.field, refused.value.limit) == ("rollback", 4)
    assert "keeps the last 4 changes only" in refused.value.message


def test_changes_racing_from_many_operators_keep_the_stack_equal_to_the_history(r: redis.Redis[bytes]) -> None:
    """Pins and rollbacks from four threads at once: the stored stack is the one the (untrimmed) history gives."""
    errors: list[BaseException] = []

    def operator(n: int) -> None:
        try:
            for i in range(25):
                pin(r, "m", f"{n}.{i}", f"op{n}@h")
                if i % 3 == 0:
                    rollback(r, "m", f"op{n}@h")
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=operator, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    entries = history(r, "m")
    assert len(entries) < HISTORY_KEEP
    stored = read_undo(r, "m")
    assert stored is not None and stored.versions == undo_of_history(entries, may_be_trimmed=False).versions
