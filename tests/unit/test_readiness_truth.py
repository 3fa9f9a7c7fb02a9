"""Readiness that tells the truth, its pure parts: the engine's failure streak, the watch of the threads a worker
needs, the reason in words, and the scheduler's notice of its own death (a fake engine: no ORT, no Redis).

The worker-level checks (a real model failing in ONNX Runtime, a killed thread, SIGTERM) are in
tests/integration/test_readiness_truth.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import pytest

from protocol.messages import OutputSpec
from tests.unit.test_scheduler import POISON, FakeEngine
from workers.jobs import JobOutcome, JobResult
from workers.policy import BatchPolicy, Dispatch, Pending, Wait
from workers.progress import FailureStreak, ProgressReport, ThreadWatch, not_ready_reason
from workers.scheduler import Job, Scheduler

OK = JobOutcome("1", "stable", True, None)
FAILED = JobOutcome("1", "stable", False, None)


@pytest.mark.parametrize(
    ("reports", "in_a_row", "failing"),
    [
        ([], 0, False),
        ([[FAILED]] * 2, 2, False),
        ([[FAILED]] * 3, 3, True),
        ([[FAILED]] * 5, 5, True),
        ([[FAILED]] * 3 + [[OK]], 0, False),  # ready again after a success
        ([[FAILED]] * 3 + [[FAILED, OK]], 0, False),  # one success in a run ends the streak
        ([[FAILED, FAILED, FAILED]], 1, False),  # one batch of three failed requests is one failed run
        ([[FAILED]] * 2 + [[]] + [[FAILED]], 3, True),  # an empty report (nothing ran) changes nothing
    ],
)
def test_the_streak_counts_runs_without_a_success(reports: list[list[JobOutcome]], in_a_row: int,
                                                  failing: bool) -> None:
    streak = FailureStreak(limit=3)
    for report in reports:
        streak.observe(report)
    assert (streak.failed_in_a_row, streak.failing) == (in_a_row, failing)


def test_the_streak_says_when_failing_changes() -> None:
    streak = FailureStreak(limit=2)
    assert [streak.observe(r) for r in ([FAILED], [FAILED], [FAILED], [OK], [OK], [FAILED])] == \
        [False, True, False, True, False, False]


IDLE = ProgressReport(held=0, queued=0, stalled_for_s=0.0, stalled=False, overdue=0)
STALLED = ProgressReport(held=2, queued=0, stalled_for_s=130.0, stalled=True, overdue=0)


def _failing() -> FailureStreak:
    streak = FailureStreak(limit=1)
    streak.observe([FAILED])
    return streak


@pytest.mark.parametrize(
    ("state", "says"),
    [
        ({}, None),
        ({"report": STALLED}, "it holds 2 requests and made no progress for 130 s (worker.stall_after_s=120)"),
        ({"failures": _failing(), "report": STALLED}, "its engine failed 1 runs in a row, none succeeded "
                                                       "(worker.not_ready_after_failed_runs=1)"),
        ({"dead_threads": ["fleet-scheduler"], "failures": _failing()}, "thread fleet-scheduler died"),
        ({"consuming": False, "dead_threads": ["fleet-scheduler"]}, "its consumer does not run"),
        ({"shutting_down": True, "consuming": False}, "shutting down (draining what it holds"),
    ],
)
def test_the_reason_is_the_first_that_applies(state: dict[str, Any], says: str | None) -> None:
    args: dict[str, Any] = {"consuming": True, "shutting_down": False, "dead_threads": [],
                            "failures": FailureStreak(limit=1), "report": IDLE, "stall_after_s": 120.0, **state}
    reason = not_ready_reason(**args)
    assert reason == says if says is None else (reason is not None and reason.startswith(says)), reason


def test_a_thread_that_ended_is_named_once_started_and_until_the_worker_closes() -> None:
    watch = ThreadWatch()
    done = threading.Event()
    lives = threading.Thread(target=done.wait, name="lives", daemon=True)
    dies = threading.Thread(target=lambda: None, name="dies", daemon=True)
    watch.watch(lives, dies)
    assert watch.dead() == []  # not started: not dead
    lives.start()
    dies.start()
    dies.join()
    assert watch.dead() == ["dies"]
    watch.ended(lives)  # its notice, from itself as it ends: dead before it finishes
    assert lives.is_alive() and watch.dead() == ["lives", "dies"]
    watch.closing()
    done.set()
    lives.join()
    assert watch.dead() == []  # the worker stops them: ends, not deaths


class _Raising(BatchPolicy):
    """A policy whose decision raises: a bug in the scheduler's loop, outside what it catches."""

    def decide(self, now_s: float, pending: Sequence[Pending], arriving: int = 0) -> Dispatch | Wait:
        raise RuntimeError("policy bug")


def test_the_scheduler_thread_announces_its_death() -> None:
    sched = Scheduler(FakeEngine(), _Raising(4, 10, 1000))  # type: ignore[arg-type]
    died = threading.Event()
    sched.on_death.append(died.set)
    sched.start()
    assert died.wait(30), "no death notice"
    sched.thread.join(30)
    assert not sched.thread.is_alive()


def _outcomes(futures: list[Future[JobResult]]) -> None:
    for f in futures:
        f.exception(timeout=10)


def test_the_scheduler_reports_failed_runs_and_not_refused_requests() -> None:
    """Outcome observers see one report per batch: all failed (a poisoned engine run), mixed (a failed batch's
    retries, one succeeding), none at all for a request whose deadline passed before compute."""
    sched = Scheduler(FakeEngine(), BatchPolicy(2, 10_000, 1000, close_when_idle=False))  # type: ignore[arg-type]
    streak = FailureStreak(limit=2)

    def observe(outcomes: list[JobOutcome]) -> None:
        streak.observe(outcomes)

    sched.add_outcome_observer(observe)
    spec = OutputSpec(kind="next_token", top_k=1)
    sched.start()
    try:
        _outcomes([sched.submit(Job([POISON], spec)), sched.submit(Job([POISON, 1], spec))])
        assert streak.failed_in_a_row == 1  # a batch of two failed requests (and their retries): one run
        _outcomes([sched.submit(Job([POISON], spec)), sched.submit(Job([POISON], spec))])
        assert streak.failing
        _outcomes([sched.submit(Job([1], spec, deadline_s=time.monotonic() - 1)),
                   sched.submit(Job([2], spec, deadline_s=time.monotonic() - 1))])
        assert streak.failed_in_a_row == 2  # refused unrun: not the engine's failure, not its success either
        _outcomes([sched.submit(Job([POISON], spec)), sched.submit(Job([5], spec))])
        assert streak.failed_in_a_row == 0 and not streak.failing  # one of the batch succeeded on retry
    finally:
        sched.stop()
