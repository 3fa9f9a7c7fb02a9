"""The progress watch behind readiness: a table of samples with a fake clock, no threads, no Redis."""

from __future__ import annotations

from typing import Any

import pytest

from workers.progress import Held, ProgressCollector, ProgressWatch, WorkerProgress, deadline_of

STALL_S = 10.0
GRACE_S = 5.0
NO_DEADLINE_S = 100.0


def watch() -> ProgressWatch:
    return ProgressWatch(STALL_S, GRACE_S, NO_DEADLINE_S)


def held(*ids: str, deadline: float | None = None) -> list[Held]:
    return [Held(i, deadline) for i in ids]


def test_slots_taken_and_nothing_finishing_is_a_stall() -> None:
    w = watch()
    assert not w.observe(0, 1000, held("a", "b"), work_done=3).stalled  # taking is progress
    r = w.observe(9.9, 1009.9, held("a", "b"), work_done=3)
    assert not r.stalled and r.stalled_for_s == pytest.approx(9.9) and r.held == 2
    r = w.observe(10, 1010, held("a", "b"), work_done=3)
    assert r.stalled and r.stalled_for_s == pytest.approx(10)


@pytest.mark.parametrize(
    ("later_held", "later_work", "queued"),
    [
        (["a"], 3, 0),  # b finished
        (["a", "b", "c"], 3, 0),  # c taken
        (["a", "b"], 4, 0),  # the engine ran a batch or a generation step
        ([], 3, 0),  # idle
    ],
)
def test_progress_resets_the_stall(later_held: list[str], later_work: int, queued: int) -> None:
    w = watch()
    w.observe(0, 1000, held("a", "b"), work_done=3)
    assert w.observe(20, 1020, held("a", "b"), work_done=3).stalled
    r = w.observe(21, 1021, held(*later_held), work_done=later_work, queued=queued)
    assert not r.stalled and r.stalled_for_s == 0
    assert not w.observe(30, 1030, held(*later_held), work_done=later_work, queued=queued).stalled


def test_a_queue_that_waits_while_nothing_is_taken_is_a_stall() -> None:
    w = watch()
    w.observe(0, 1000, [], work_done=0, queued=0)
    assert not w.observe(5, 1005, [], work_done=0, queued=4).stalled
    r = w.observe(15, 1015, [], work_done=0, queued=4)
    assert r.stalled and r.stalled_for_s == pytest.approx(15) and r.queued == 4


def test_an_idle_worker_never_stalls() -> None:
    w = watch()
    for t in range(0, 1000, 50):
        assert not w.observe(t, 1000 + t, [], work_done=0).stalled


def test_a_slot_past_its_deadline_and_grace_is_reported_once() -> None:
    w = watch()
    assert w.observe(0, 1000, held("a", deadline=1010), work_done=0).overdue == 0
    assert w.observe(15, 1015, held("a", deadline=1010), work_done=1).overdue == 0  # grace: until 1015
    r = w.observe(15.5, 1015.5, held("a", deadline=1010), work_done=2)
    assert r.overdue == 1 and [h.task_id for h in r.newly_overdue] == ["a"]
    r = w.observe(16, 1016, held("a", deadline=1010), work_done=3)
    assert r.overdue == 1 and r.newly_overdue == ()  # reported once
    assert w.observe(17, 1017, [], work_done=3).overdue == 0


def test_a_slot_without_a_deadline_is_overdue_after_the_visibility_timeout() -> None:
    w = watch()
    w.observe(50, 1050, held("a"), work_done=0)
    assert w.observe(50 + NO_DEADLINE_S + GRACE_S, 0, held("a"), work_done=1).overdue == 0
    assert w.observe(50 + NO_DEADLINE_S + GRACE_S + 0.1, 0, held("a"), work_done=2).overdue == 1


@pytest.mark.parametrize(
    ("args", "deadline"),
    [
        ([{"model": "m", "deadline_unix_s": 12.5}], 12.5),
        ([{"model": "m"}], None),
        ([{"requests": [{"deadline_unix_s": 3}, {"deadline_unix_s": 7}]}], 7.0),
        ([{"requests": [{"deadline_unix_s": 3}, {}]}], None),
        ([{"requests": []}], None),
        ([{"deadline_unix_s": True}], None),
        ([], None),
        (None, None),
        (["x"], None),
    ],
)
def test_deadline_of(args: Any, deadline: float | None) -> None:
    assert deadline_of(args) == deadline


def test_worker_progress_reads_the_queue_only_when_nothing_is_held_and_exports_series() -> None:
    now = [0.0]
    holding: list[Held] = []
    reads: list[int] = []

    def queued() -> int:
        reads.append(1)
        return 2

    progress = WorkerProgress(watch(), work_done=lambda: 0, queued=queued, held=lambda: list(holding),
                              clock=lambda: now[0])
    assert progress.check().queued == 2 and len(reads) == 1
    holding.append(Held("a", 0.0))  # a deadline long past
    now[0] = 20.0
    report = progress.check()
    assert report.queued == 0 and len(reads) == 1 and report.overdue == 1 and progress.overdue_total == 1
    now[0] = 40.0
    assert progress.check().stalled
    series = {m.name: m.samples[0].value for m in ProgressCollector("m", progress, lambda: 7).collect()}
    assert series == {
        "fleet_worker_held_slots": 1, "fleet_worker_stalled": 1, "fleet_worker_stalled_seconds": 20,
        "fleet_worker_overdue_slots": 1, "fleet_worker_overdue_slots_reported": 1,
        "fleet_worker_outside_body_errors": 7,
    }
