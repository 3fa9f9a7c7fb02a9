"""A cancel heard while a one-step job waits for its batch (pure logic: no Redis, no ORT, no sleeps).

:class:`workers.cancel_watch.CancelWatch` hands heard cancels to watched requests, remembering IDs heard
before their watch; :meth:`workers.scheduler.Scheduler.cancel` takes a waiting job out of the window, refuses
one not handed over yet, and leaves one whose batch has formed to its result.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from functools import partial
from typing import Any

import pytest

from protocol.errors import RequestCancelled
from protocol.messages import OutputSpec
from tests.unit.test_scheduler import FakeEngine, make
from workers.cancel_watch import CancelWatch
from workers.padding import PaddedBatch
from workers.policy import BatchPolicy
from workers.scheduler import Job, JobResult
from workers.stream_publisher import StreamPublisher


def _job(token: int, request_id: str = "") -> Job:
    return Job([token], OutputSpec(kind="next_token", top_k=1), request_id=request_id)


# -- CancelWatch ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "calls", "watched_after"),
    [
        ([("watch", "a"), ("heard", "a")], ["a"], []),  # heard while it waits: ended once
        ([("heard", "a"), ("watch", "a")], ["a"], []),  # heard between its take and its watch: ended as watched
        ([("watch", "a"), ("heard", "b")], [], ["a"]),  # another worker's request: nothing here
        ([("watch", "a"), ("done", "a"), ("heard", "a")], [], []),  # its batch resolved it: the watch ended
        ([("watch", "a"), ("heard", "a"), ("heard", "a")], ["a"], []),  # heard twice (listener + catch-up): once
        ([("heard", "a"), ("heard", "b"), ("heard", "c"), ("watch", "a")], [], ["a"]),  # "a" forgotten (remember=2)
    ],
    ids=["watch-heard", "heard-watch", "other-id", "done-first", "heard-twice", "forgotten"],
)
def test_a_heard_cancel_reaches_the_waiting_request_once(
    steps: list[tuple[str, str]], calls: list[str], watched_after: list[str]
) -> None:
    watch = CancelWatch(remember=2)
    futures: dict[str, Future[Any]] = {}
    called: list[str] = []
    for step, rid in steps:
        if step == "watch":
            futures[rid] = Future()
            watch.watch(rid, futures[rid], partial(called.append, rid))
        elif step == "heard":
            watch.heard(rid)
        else:
            futures[rid].set_result(None)
    assert called == calls
    assert watch.ids() == watched_after and len(watch) == len(watched_after)


def test_a_later_watch_of_the_same_id_is_not_ended_by_the_earlier_one_s_future() -> None:
    watch = CancelWatch()
    first: Future[Any] = Future()
    second: Future[Any] = Future()
    called: list[str] = []
    watch.watch("a", first, lambda: called.append("first"))
    watch.watch("a", second, lambda: called.append("second"))
    first.set_result(None)  # the first one's end does not drop the second's watch
    assert watch.heard("a") is True and called == ["second"]


def test_remember_must_be_positive() -> None:
    with pytest.raises(ValueError, match="remember"):
        CancelWatch(remember=0)


@pytest.mark.parametrize(("heard_ago_s", "cancelled"), [(30.0, True), (60.0, True), (61.0, False)],
                         ids=["mark-lives", "mark-ends-now", "mark-expired"])
def test_an_id_heard_cancelled_is_remembered_as_long_as_its_mark_lives(heard_ago_s: float, cancelled: bool) -> None:
    """A cancel heard stands for its mark (``fleet:cancel:<id>``, TTL ``result_ttl_s``). Past that life the ID may
    name a new request (an idempotency key sent again once its result and marker expired), which no cancel
    names: it runs. Before, an ID stayed remembered until 4,096 later cancels pushed it out (days on a fleet
    that cancels little), and the new request ended RequestCancelled, unrun."""
    now = [1000.0]
    watch = CancelWatch(forget_after_s=60, clock=lambda: now[0])
    sched, engine = make(BatchPolicy(1, 10_000, 1000))
    watch.heard("key-1")  # the first request sent under this key was cancelled
    now[0] += heard_ago_s
    job = _job(4, "key-1")  # the key sent again: taken (no mark in Redis by then), waiting in the window
    future = sched.submit(job)
    watch.watch("key-1", future, partial(sched.cancel, job))  # as workers.pipeline.prepare watches it
    sched.start()
    try:
        if cancelled:
            assert isinstance(future.exception(timeout=10), RequestCancelled) and engine.batches == []
        else:
            assert future.result(timeout=10).top_ids == [5] and engine.batches == [[1]]
    finally:
        sched.stop()


def test_an_id_heard_again_is_remembered_from_its_last_hearing_and_others_are_forgotten_in_turn() -> None:
    now = [0.0]
    watch = CancelWatch(forget_after_s=60, clock=lambda: now[0])
    watch.heard("a")
    now[0] = 10.0
    watch.heard("b")
    now[0] = 50.0
    watch.heard("a")  # heard again (a second cancel of it): remembered from now
    now[0] = 75.0  # a's first hearing and b's are past 60 s, a's second is not
    called: list[str] = []
    for rid in ("a", "b"):
        watch.watch(rid, Future(), partial(called.append, rid))
    assert called == ["a"] and watch.ids() == ["b"]


def test_the_publisher_remembers_a_heard_cancel_as_long_as_the_marks_live() -> None:
    publisher = StreamPublisher(_Marks(set()), ttl_s=120)  # type: ignore[arg-type]  # its threads are not started
    assert publisher.waiting.forget_after_s == 120


# -- Scheduler.cancel -------------------------------------------------------------------------------


def test_a_job_cancelled_in_the_window_ends_at_once_and_the_batch_runs_without_it() -> None:
    sched, engine = make(BatchPolicy(3, 10_000, 1000, close_when_idle=False))
    first, doomed = _job(1, "r-1"), _job(2, "r-2")
    futures = [sched.submit(first), sched.submit(doomed)]
    assert sched.cancel(doomed) is True
    exc = doomed.future.exception(timeout=0)  # at once: not at the window's end
    assert isinstance(exc, RequestCancelled) and exc.args == ("request r-2 was cancelled before it ran",
                                                              "request_id", None)  # fmt: skip
    assert sched.pending_count == 1 and sched.cancel(doomed) is False  # gone: a second cancel changes nothing
    futures += [sched.submit(_job(3)), sched.submit(_job(4))]  # first, 3, 4 fill the batch of 3
    sched.start()
    done = [futures[i].result(timeout=10) for i in (0, 2, 3)]
    sched.stop()
    assert engine.batches == [[1, 1, 1]]
    assert [d.top_ids for d in done] == [[2], [4], [5]] and all(d.batch_size == 3 for d in done)


def test_a_bulk_job_cancelled_before_it_is_handed_over_is_refused_and_its_siblings_run() -> None:
    sched, engine = make(BatchPolicy(2, 10_000, 1000, close_when_idle=False))
    jobs = [_job(1, "b-1"), _job(2, "b-2"), _job(3, "b-3")]
    assert sched.cancel(jobs[1]) is True  # prepared, not yet handed over (workers.bulk gathers them first)
    sched.submit_many(jobs)
    assert isinstance(jobs[1].future.exception(timeout=0), RequestCancelled) and sched.pending_count == 2
    sched.start()
    done = [jobs[i].future.result(timeout=10) for i in (0, 2)]
    sched.stop()
    assert engine.batches == [[1, 1]] and [d.top_ids for d in done] == [[2], [4]]


def test_an_announced_job_cancelled_before_its_submit_is_refused_and_its_arrival_counted_off() -> None:
    sched, _ = make(BatchPolicy(2, 10_000, 1000, close_when_idle=False))
    job = _job(1, "a-1")
    with sched.arrival("a-1") as arrival:
        assert sched.cancel(job) is True
        future = arrival.submit(job)
    assert isinstance(future.exception(timeout=0), RequestCancelled)
    assert sched.pending_count == 0 and sched._arriving == 0


class _HeldEngine(FakeEngine):
    """A fake engine whose run waits until released, saying when it started."""

    def __init__(self) -> None:
        super().__init__()
        self.running = threading.Event()
        self.release = threading.Event()

    def run(self, batch: PaddedBatch) -> Any:
        self.running.set()
        assert self.release.wait(10)
        return super().run(batch)


def test_a_job_whose_batch_runs_is_not_cancelled_its_result_wins() -> None:
    from workers.scheduler import Scheduler

    engine = _HeldEngine()
    sched = Scheduler(engine, BatchPolicy(1, 10_000, 1000))  # type: ignore[arg-type]
    job = _job(7, "r-7")
    future = sched.submit(job)
    sched.start()
    try:
        assert engine.running.wait(10)
        assert sched.cancel(job) is False
    finally:
        engine.release.set()
    assert isinstance(future.result(timeout=10), JobResult)
    sched.stop()


# -- the listener's catch-up --------------------------------------------------------------------------


class _Marks:
    """The one command the catch-up sends: ``MGET`` of the waiting requests' marks."""

    def __init__(self, marked: set[str]) -> None:
        self.marked = marked
        self.mgets: list[list[str]] = []

    def set_retry(self, retry: Any) -> None:
        pass

    def mget(self, keys: list[str]) -> list[bytes | None]:
        self.mgets.append(keys)
        return [b"1" if key.rsplit(":", 1)[-1] in self.marked else None for key in keys]


def test_once_subscribed_the_listener_reads_back_the_marks_of_the_waiting_requests() -> None:
    """A cancel published while the listener was not subscribed (a reconnect) is never heard: the marks of
    the requests waiting then are read once, and the marked ones end."""
    marks = _Marks({"r-2"})
    publisher = StreamPublisher(marks, ttl_s=60)  # type: ignore[arg-type]  # its threads are not started
    publisher.cancels._catch_up()
    assert marks.mgets == []  # nothing waits: no command
    called: list[str] = []
    for rid in ("r-1", "r-2"):
        publisher.waiting.watch(rid, Future(), partial(called.append, rid))
    publisher.cancels._catch_up()
    assert marks.mgets == [["fleet:cancel:r-1", "fleet:cancel:r-2"]] and called == ["r-2"]
    assert publisher.waiting.ids() == ["r-1"]
