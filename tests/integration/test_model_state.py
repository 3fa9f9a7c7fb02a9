"""Model-state transactions against a real redis-server: history entries, pub/sub notices, refusals,
outcomes and the canary guard (concurrent guards roll back once)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from protocol.errors import StateChangeRefused
from protocol.model_state import (
    AUTO_ROLLBACKS_KEY,
    CHANGES_CHANNEL,
    Outcome,
    guard_canary,
    history,
    pin,
    promote,
    read_outcomes,
    read_state,
    record_outcomes,
    record_refusal,
    refusals,
    rollback,
    set_canary,
)
from protocol.settings import load_settings
from store import ChecksumMismatch, VersionNotFound
from tools.redis_server import EmbeddedRedis


@pytest.fixture
def r(redis_server: EmbeddedRedis) -> redis.Redis[bytes]:
    return redis_server.client()


def test_changes_are_recorded_with_from_and_to(r: redis.Redis[bytes]) -> None:
    sub = r.pubsub()
    sub.subscribe(CHANGES_CHANNEL)
    confirmed = sub.get_message(timeout=10)  # Redis's reply: from here on every notice reaches us
    assert confirmed is not None and confirmed["type"] == "subscribe", confirmed
    assert read_state(r, "m") is None
    pin(r, "m", "1.0.0", "ann@h1")
    set_canary(r, "m", "1.1.0", 10, "bob@h2")
    promote(r, "m", "ann@h1")
    set_canary(r, "m", "1.2.0", 25, "ann@h1")
    rollback(r, "m", "bob@h2", reason="looks slow")
    rollback(r, "m", "bob@h2")  # no canary: the stable goes back to the one before the promote
    state = read_state(r, "m")
    assert state is not None
    assert (state.stable, state.canary, state.canary_weight, state.generation) == ("1.0.0", None, 0, 6)
    assert state.changed_by == "bob@h2"
    entries = history(r, "m")
    assert [e.action for e in entries] == ["pin", "canary", "promote", "canary", "rollback", "rollback"]
    assert [e.generation for e in entries] == [1, 2, 3, 4, 5, 6]
    assert entries[1].from_.stable == "1.0.0" and entries[1].to.canary == "1.1.0" and entries[1].to.canary_weight == 10
    assert entries[2].to.stable == "1.1.0" and entries[2].to.canary is None
    assert entries[4].reason == "looks slow" and entries[4].from_.canary == "1.2.0" and entries[4].to.stable == "1.1.0"
    assert entries[5].from_.stable == "1.1.0" and entries[5].to.stable == "1.0.0"
    assert [e.by for e in history(r, "m", last=2)] == ["bob@h2", "bob@h2"]
    notices: list[bytes] = []
    deadline = time.monotonic() + 10
    while len(notices) < 6 and time.monotonic() < deadline:
        msg = sub.get_message(timeout=1)
        if msg and msg["type"] == "message":
            notices.append(msg["data"])
    assert notices == [b"m"] * 6


def test_refused_changes_leave_state_alone(r: redis.Redis[bytes], tmp_path: Path) -> None:
    pin(r, "m", "1", "u@h")
    with pytest.raises(StateChangeRefused, match="weight must be between 1 and 99") as exc:
        set_canary(r, "m", "2", 100, "u@h")
    assert exc.value.field == "weight" and exc.value.limit == "1..99"
    with pytest.raises(StateChangeRefused, match="no canary to promote"):
        promote(r, "m", "u@h")
    with pytest.raises(StateChangeRefused, match="n has no canary and no pin or promote to undo"):
        rollback(r, "n", "u@h")
    with pytest.raises(StateChangeRefused, match="already the stable version"):
        set_canary(r, "m", "1", 10, "u@h")
    from store.model_store import open_store

    settings = load_settings(None, store={"backend": "local", "root": str(tmp_path / "store")})
    with pytest.raises(VersionNotFound, match=r"m 9\.9 is not published"):
        pin(r, "m", "9.9", "u@h", store=open_store(settings.store))
    state = read_state(r, "m")
    assert state is not None and state.generation == 1 and state.stable == "1"
    assert len(history(r, "m")) == 1


def test_refusals_are_kept_capped_and_expiring(r: redis.Redis[bytes]) -> None:
    err = ChecksumMismatch("m/2/m.onnx: sha256 abc..., manifest says def...", "m/2/m.onnx", "def")
    for i in range(55):
        record_refusal(r, "m", f"w{i}@host", "2", err)
    got = refusals(r, "m")
    assert len(got) == 50 and got[-1].worker == "w54@host" and got[0].worker == "w5@host"
    assert got[-1].error_type == "ChecksumMismatch" and "manifest says def" in got[-1].error
    assert 0 < r.ttl("fleet:model-refusals:m") <= 7 * 86_400


def _outcomes(version: str, role: str, n: int, ok: bool) -> list[Outcome]:
    now = time.time()
    return [Outcome(version, "canary" if role == "canary" else "stable", ok, 5.0, now) for _ in range(n)]


def test_guard_rolls_back_once_under_concurrent_callers(r: redis.Redis[bytes]) -> None:
    settings = load_settings(None, models={"m": {"path": "/nonexistent.onnx", "canary": {"min_requests": 20}}})
    pin(r, "m", "1", "u@h")
    set_canary(r, "m", "2", 10, "u@h")
    pipe = r.pipeline(transaction=False)
    record_outcomes(pipe, "m", [*_outcomes("1", "stable", 50, True), *_outcomes("2", "canary", 19, False)])
    pipe.execute()
    verdict = guard_canary(r, settings, "m")
    assert verdict is not None and not verdict.rollback  # 19 < min_requests
    pipe = r.pipeline(transaction=False)
    record_outcomes(pipe, "m", _outcomes("2", "canary", 5, False))
    pipe.execute()
    assert len(read_outcomes(r, "m", 60)) == 74

    barrier = threading.Barrier(8)
    verdicts = []

    def guard() -> None:
        barrier.wait()
        verdicts.append(guard_canary(r, settings, "m"))

    threads = [threading.Thread(target=guard) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(v is None or v.rollback for v in verdicts)
    assert int(r.get(AUTO_ROLLBACKS_KEY.format(model="m")) or 0) == 1
    autos = [e for e in history(r, "m") if e.action == "auto-rollback"]
    assert len(autos) == 1
    assert autos[0].by == "auto-rollback" and autos[0].reason and "error rate 1.000 (24/24)" in autos[0].reason
    assert autos[0].figures is not None and autos[0].figures["canary"]["requests"] == 24
    state = read_state(r, "m")
    assert state is not None and state.canary is None and state.stable == "1"
    assert guard_canary(r, settings, "m") is None  # no canary any more


def test_one_worker_per_check_interval_reads_the_outcome_window(r: redis.Redis[bytes]) -> None:
    """Every worker runs the guard every check_interval_s; only one of them per interval reads the window."""
    settings = load_settings(None, models={"m": {"path": "/nonexistent.onnx"}})
    pin(r, "m", "1", "u@h")
    set_canary(r, "m", "2", 10, "u@h")
    pipe = r.pipeline(transaction=False)
    record_outcomes(pipe, "m", [*_outcomes("1", "stable", 30, True), *_outcomes("2", "canary", 30, True)])
    pipe.execute()
    r.config_resetstat()
    judged = [guard_canary(r, settings, "m", one_caller_per_s=30.0) for _ in range(6)]
    reads = int(r.info("commandstats").get("cmdstat_xrange", {}).get("calls", 0)) + int(
        r.info("commandstats").get("cmdstat_xrevrange", {}).get("calls", 0))
    assert judged[0] is not None and not judged[0].rollback
    assert judged[1:] == [None] * 5, judged
    assert reads == 1, reads
    r.delete("fleet:model-guard-turn:m")
    assert guard_canary(r, settings, "m", one_caller_per_s=30.0) is not None  # the next period's turn


def test_a_canary_every_worker_refused_is_rolled_back_once_its_traffic_ran_on_stable(r: redis.Redis[bytes]) -> None:
    """A canary no worker could load served nothing: its traffic ran on stable and the error-rate bounds
    never saw it. Rolled back, with the refusal as the reason, once min_requests canary requests finished."""
    settings = load_settings(None, models={"m": {"path": "/nonexistent.onnx", "canary": {"min_requests": 10}}})
    pin(r, "m", "1", "u@h")
    set_canary(r, "m", "2", 10, "u@h")
    pipe = r.pipeline(transaction=False)
    record_outcomes(pipe, "m", [*_outcomes("1", "stable", 30, True), *_outcomes("1", "canary", 12, True)])
    pipe.execute()
    verdict = guard_canary(r, settings, "m")
    assert verdict is not None and not verdict.rollback  # no refusal: a worker may still be loading it
    record_refusal(r, "m", "w1@host", "2", ValueError("demo-lm 2: model.onnx does not match its manifest"))
    verdict = guard_canary(r, settings, "m")
    assert verdict is not None and verdict.rollback and verdict.reason is not None
    assert "refused by 1 worker(s) (w1@host)" in verdict.reason and "does not match its manifest" in verdict.reason
    state = read_state(r, "m")
    assert state is not None and state.canary is None and state.stable == "1"
    assert [e.action for e in history(r, "m")][-1] == "auto-rollback"


def test_repeated_rollbacks_undo_pins_one_at_a_time(r: redis.Redis[bytes]) -> None:
    for version in ("A", "B", "A"):
        pin(r, "m", version, "u@h")
    walked = []
    for _ in range(3):
        rollback(r, "m", "u@h")
        state = read_state(r, "m")
        assert state is not None
        walked.append(state.stable)
    assert walked == ["B", "A", None]  # None: back to the configured version
    with pytest.raises(StateChangeRefused, match="no pin or promote to undo"):
        rollback(r, "m", "u@h")
