"""workers.run_claims against a real redis-server: who runs a generation's ID, who waits, who runs nothing.

The waits are driven by the ``sleep`` hook (each call is one poll), so no test depends on timing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from protocol.keys import RESULT_KEY, RUN_KEY
from tools.redis_server import EmbeddedRedis
from workers.run_claims import Delivery, RunClaims

RID = "gen-1"


@pytest.fixture
def r(redis_server: EmbeddedRedis) -> redis.Redis[bytes]:
    return redis.Redis(port=redis_server.port)


def _claims(r: redis.Redis[bytes], owner: str, sleep: Callable[[float], None] = lambda _s: None,
            ttl_s: float = 30) -> RunClaims:  # fmt: skip
    return RunClaims(r, owner=f"{owner}-instance {owner}@host", ttl_s=ttl_s, sleep=sleep)


def _store(r: redis.Redis[bytes], status: str) -> None:
    r.set(RESULT_KEY.format(id=RID), json.dumps({"status": status, "result": None, "task_id": RID}))


class _Clock:
    """A monotonic clock the test moves (s)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class _Polls:
    """A waiting delivery's ``sleep`` hook: counts its polls and runs ``steps[n]`` at the n-th (from 1)."""

    def __init__(self, steps: dict[int, Callable[[], Any]]) -> None:
        self.steps = steps
        self.count = 0

    def __call__(self, _s: float) -> None:
        self.count += 1
        assert self.count < 20, "still waiting"
        step = self.steps.get(self.count)
        if step is not None:
            step()


def test_the_first_delivery_claims_and_a_started_state_does_not_count_as_an_outcome(r: redis.Redis[bytes]) -> None:
    _store(r, "STARTED")  # a generation's own STARTED state, stored before it runs
    a = _claims(r, "a")
    assert a.acquire(RID) is True
    assert r.get(RUN_KEY.format(id=RID)) == a.owner.encode() and 0 < r.pttl(RUN_KEY.format(id=RID)) <= 30_000
    assert a.held() == [RID] and (a.waited, a.skipped_stored) == (0, 0)


@pytest.mark.parametrize("status", ["SUCCESS", "FAILURE", "REVOKED"])
def test_a_stored_outcome_means_run_nothing_and_claim_nothing(r: redis.Redis[bytes], status: str) -> None:
    _store(r, status)
    a = _claims(r, "a")
    assert a.acquire(RID) is False
    assert not r.exists(RUN_KEY.format(id=RID)) and a.held() == [] and a.skipped_stored == 1


def test_a_second_delivery_waits_until_the_outcome_is_stored_then_runs_nothing(r: redis.Redis[bytes]) -> None:
    a = _claims(r, "a")
    assert a.acquire(RID)
    polls: list[frozenset[str]] = []

    def poll(_s: float) -> None:
        polls.append(b.waiting)
        if len(polls) == 3:
            _store(r, "SUCCESS")  # the holder's result lands while the copy waits

    b = _claims(r, "b", poll)
    assert b.acquire(RID) is False
    assert polls == [frozenset({RID})] * 3  # waiting the whole time: readiness leaves it out
    assert b.waiting == frozenset() and b.held() == [] and (b.waited, b.skipped_stored, b.taken_over) == (1, 1, 0)
    assert r.get(RUN_KEY.format(id=RID)) == a.owner.encode()  # the holder's claim is untouched


def test_a_waiting_delivery_takes_over_a_claim_that_lapses_without_an_outcome(r: redis.Redis[bytes],
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    a = _claims(r, "a")
    assert a.acquire(RID)
    clock = _Clock()

    def lapse() -> None:  # its holder died: the claim's life passes, it lapses, no outcome stored
        clock.now_s += 30
        r.delete(RUN_KEY.format(id=RID))

    b = RunClaims(r, owner="b-instance b@host", ttl_s=30, sleep=_Polls({2: lapse}), clock=clock)
    with caplog.at_level(logging.INFO, logger="fleet.worker"):
        assert b.acquire(RID) is True
    assert r.get(RUN_KEY.format(id=RID)) == b.owner.encode() and b.held() == [RID] and b.taken_over == 1
    assert "the claim of a@host lapsed without an outcome" in caplog.text, caplog.text
    assert "is already running (claimed by a@host)" in caplog.text


def test_the_same_process_s_second_delivery_waits_too(r: redis.Redis[bytes]) -> None:
    stored = False

    def poll(_s: float) -> None:
        nonlocal stored
        stored = True
        _store(r, "FAILURE")

    a = _claims(r, "a", poll)
    assert a.acquire(RID) is True
    assert a.acquire(RID) is False and stored  # the second copy waited for the first's outcome


def test_renew_extends_writes_back_a_lost_claim_and_lets_go_of_one_taken(r: redis.Redis[bytes],
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    a = _claims(r, "a", ttl_s=5)
    for rid in ("g1", "g2", "g3"):
        assert a.acquire(rid)
    r.pexpire(RUN_KEY.format(id="g1"), 100)
    r.delete(RUN_KEY.format(id="g2"))  # Redis lost it (a restart without persistence)
    r.set(RUN_KEY.format(id="g3"), "other-instance b@host")  # its claim lapsed and another delivery took it
    with caplog.at_level(logging.WARNING, logger="fleet.worker"):
        a.renew()
    assert r.pttl(RUN_KEY.format(id="g1")) > 1000
    assert r.get(RUN_KEY.format(id="g2")) == a.owner.encode() and r.pttl(RUN_KEY.format(id="g2")) > 1000
    assert r.get(RUN_KEY.format(id="g3")) == b"other-instance b@host"  # never taken back
    assert a.held() == ["g1", "g2"]
    assert "generation g3: its claim lapsed" in caplog.text and "both run" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fleet.worker"):
        a.renew()
    assert "g3" not in caplog.text  # logged once
    a.release("g1")
    a.release("g2")
    assert a.held() == []


def test_renew_stops_a_generation_whose_outcome_another_delivery_stored_while_its_claim_had_lapsed(
        r: redis.Redis[bytes], caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A process frozen past its claims' life (SIGSTOP, a paused VM) wakes after another delivery ran its
    generation to the end and the claim that delivery held lapsed too. Its renewal found no claim and wrote its
    own back: the generation went on here, silently, and streamed tokens after the stream's final event. Now the
    renewal sees the stored outcome, writes no claim, and hands the ID to the worker, which stops it."""
    stopped: list[str] = []
    a = _claims(r, "a", ttl_s=5)
    a.on_ended_elsewhere = stopped.append
    for rid in ("g1", "g2"):
        assert a.acquire(rid)
    r.delete(RUN_KEY.format(id="g1"), RUN_KEY.format(id="g2"))  # both lapsed while this process was frozen
    r.set(RESULT_KEY.format(id="g1"), json.dumps({"status": "SUCCESS", "result": {}, "task_id": "g1"}))
    r.set(RESULT_KEY.format(id="g2"), json.dumps({"status": "STARTED", "result": None, "task_id": "g2"}))
    with caplog.at_level(logging.WARNING, logger="fleet.worker"):
        a.renew()
    assert stopped == ["g1"] and a.ended_elsewhere == 1
    assert r.get(RUN_KEY.format(id="g1")) is None  # not taken back: nothing of it runs on
    assert r.get(RUN_KEY.format(id="g2")) == a.owner.encode()  # no outcome yet: written back, as before
    assert a.held() == ["g2"]
    assert "generation g1: its claim lapsed" in caplog.text and "the stored result kept" in caplog.text
    a.renew()
    assert stopped == ["g1"]  # once


def test_a_result_key_of_another_type_lets_the_delivery_run_unclaimed(r: redis.Redis[bytes],
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    r.rpush(RESULT_KEY.format(id=RID), "not a result")  # GET answers WRONGTYPE: no claim can be decided
    a = _claims(r, "a")
    with caplog.at_level(logging.WARNING, logger="fleet.worker"):
        assert a.acquire(RID) is True
        assert a.acquire(RID) is True
    assert caplog.text.count("Redis refused the run-claim script") == 1


def test_redis_not_answering_is_waited_out_and_logged_once(redis_server: EmbeddedRedis,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    client = redis.Redis(port=redis_server.port, socket_connect_timeout=2, socket_timeout=2,
                         retry=Retry(NoBackoff(), 0))  # a try Redis does not answer fails at once
    polls = 0

    def poll(_s: float) -> None:
        nonlocal polls
        polls += 1
        if polls == 3:
            redis_server.start()  # back on the same port, empty

    a = _claims(client, "a", poll)
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="fleet.worker"):
        assert a.acquire(RID) is True
    assert polls == 3 and client.get(RUN_KEY.format(id=RID)) == a.owner.encode()
    assert caplog.text.count("Redis does not answer") == 1, caplog.text


def test_a_claim_redis_lost_is_not_taken_while_its_holder_can_write_it_back(r: redis.Redis[bytes],
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Redis loses the holder's claim (a restart without persistence) while a copy waits: the copy does not
    take it, the holder's next beat writes it back, and the copy runs nothing once the outcome is stored.
    Before, the copy claimed the ID at its next poll and ran the generation beside its live holder."""
    a = _claims(r, "a")
    assert a.acquire(RID)
    polls = _Polls({1: r.flushall,  # everything lost: the claim, the STARTED state
                    3: a.renew,  # the holder's next heartbeat
                    5: lambda: _store(r, "SUCCESS")})  # fmt: skip
    b = RunClaims(r, owner="b-instance b@host", ttl_s=30, sleep=polls, clock=_Clock())
    with caplog.at_level(logging.INFO, logger="fleet.worker"):
        assert b.acquire(RID) is False
    assert polls.count == 5 and (b.waited, b.skipped_stored, b.taken_over) == (1, 1, 0) and b.held() == []
    assert r.get(RUN_KEY.format(id=RID)) == a.owner.encode()
    assert caplog.text.count("the claim of a@host vanished before its life ended") == 1, caplog.text


def test_a_lost_claim_whose_holder_writes_nothing_back_is_taken_once_its_life_has_passed(
    r: redis.Redis[bytes],
) -> None:
    a = _claims(r, "a", ttl_s=30)
    assert a.acquire(RID)
    clock = _Clock()

    def life_passes() -> None:
        clock.now_s += 30

    polls = _Polls({1: lambda: r.delete(RUN_KEY.format(id=RID)),  # lost; its holder is gone too (never renews)
                    3: life_passes})  # the life the claim had when seen has passed  # fmt: skip
    b = RunClaims(r, owner="b-instance b@host", ttl_s=30, sleep=polls, clock=clock)
    assert b.acquire(RID) is True
    assert polls.count == 3 and b.taken_over == 1 and r.get(RUN_KEY.format(id=RID)) == b.owner.encode()


def test_a_claim_seen_before_redis_stopped_answering_waits_a_life_after_it_answers(
    redis_server: EmbeddedRedis,
) -> None:
    """The holder cannot renew while Redis does not answer: however long the outage, its claim is not taken
    before a full life has passed since Redis answered again (its next beat writes it back)."""
    client = redis.Redis(port=redis_server.port, socket_connect_timeout=2, socket_timeout=2,
                         retry=Retry(NoBackoff(), 0))  # a try Redis does not answer fails at once
    a = _claims(client, "a", ttl_s=3)
    assert a.acquire(RID)
    clock = _Clock()

    def long_outage() -> None:  # the claim's life passes many times over
        clock.now_s += 60

    polls = _Polls({1: redis_server.kill, 2: long_outage,
                    3: redis_server.start,  # back on the same port, empty
                    5: a.renew,  # the holder's first beat after the outage
                    6: lambda: _store(client, "SUCCESS")})  # fmt: skip
    b = RunClaims(client, owner="b-instance b@host", ttl_s=3, sleep=polls, clock=clock)
    assert b.acquire(RID) is False
    assert polls.count == 6 and b.taken_over == 0 and client.get(RUN_KEY.format(id=RID)) == a.owner.encode()


def test_a_copy_waiting_on_a_delivery_of_the_same_process_does_not_hide_it(r: redis.Redis[bytes]) -> None:
    """Readiness leaves out the IDs of waiting deliveries (:attr:`RunClaims.waiting`), but not one this process
    runs itself. Before, a copy waiting on a delivery of its own process hid that running generation too."""
    seen: list[frozenset[str]] = []

    def poll(_s: float) -> None:
        seen.append(a.waiting)
        _store(r, "SUCCESS")

    a = _claims(r, "a", poll)
    assert a.acquire(RID)  # runs here
    assert a.acquire(RID) is False  # a second delivery in the same process waited for it
    assert seen == [frozenset()]


def test_one_of_two_waiting_copies_ending_leaves_the_other_waiting(r: redis.Redis[bytes]) -> None:
    a = _claims(r, "a")
    assert a.acquire(RID)  # another process runs it
    calls = 0
    seen: list[frozenset[str]] = []

    def poll(_s: float) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:  # the first copy waits; a second one arrives, waits, and finds the outcome
            assert b.acquire(RID) is False
            seen.append(b.waiting)  # the first copy still waits
        elif calls == 2:
            _store(r, "SUCCESS")

    b = _claims(r, "b", poll)
    assert b.acquire(RID) is False
    assert seen == [frozenset({RID})] and b.waiting == frozenset() and b.waited == 2


def test_renew_keeps_the_deliveries_that_run_or_wait_visible_and_no_others(r: redis.Redis[bytes]) -> None:
    """Each beat sets the unacked-index score of every delivery that runs or waits here to now, so kombu's
    visibility-timeout restore leaves it alone; an entry acked or restored meanwhile is not written back, and a
    delivery that ended here is renewed no more."""
    index = "unacked_index"
    r.zadd(index, {"tag-run": 100.0, "tag-wait": 100.0, "tag-gone": 100.0, "tag-other": 100.0})
    in_wait: list[float] = []

    def poll(_s: float) -> None:  # while the copy waits, a beat renews both; then the outcome lands
        a.renew()
        in_wait.append(r.zscore(index, "tag-wait") or 0.0)
        _store(r, "SUCCESS")

    a = _claims(r, "a", poll)
    assert a.acquire(RID, delivery=Delivery(index, "tag-run"))
    assert a.acquire(RID, delivery=Delivery(index, "tag-wait")) is False  # a copy on the same worker waits
    assert in_wait and in_wait[0] > 1e9  # renewed to now (unix s) while it waited
    assert a.acquire("gen-2", delivery=Delivery(index, "tag-gone"))
    r.zrem(index, "tag-gone")  # acked (or restored) meanwhile
    r.zadd(index, {"tag-wait": 100.0})
    a.renew()
    scores = {tag.decode(): score for tag, score in r.zrange(index, 0, -1, withscores=True)}
    assert scores["tag-run"] > 1e9 and "tag-gone" not in scores  # never written back
    assert scores["tag-wait"] == 100.0 and scores["tag-other"] == 100.0  # ended here / not ours: untouched
    a.release(RID)
    r.zadd(index, {"tag-run": 100.0})
    a.renew()
    assert r.zscore(index, "tag-run") == 100.0  # its generation ended: renewed no more
