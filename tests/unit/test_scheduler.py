"""Scheduler loop around a fake engine (pure logic: no ORT, no Redis)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from protocol.errors import RequestExpired
from protocol.messages import OutputSpec
from protocol.modelcard import ModelCard
from workers.padding import PaddedBatch
from workers.policy import BatchPolicy
from workers.progress import copied
from workers.scheduler import BatchStats, Job, JobResult, Scheduler

POISON = 13


class FakeEngine:
    """Logits that put all mass on (last real token + 1); a batch containing POISON raises."""

    card = ModelCard(
        name="fake",
        version="0",
        kind="causal_lm",
        vocab_size=32,
        max_positions=64,
        num_layers=1,
        num_heads=1,
        head_dim=1,
        hidden_size=1,
    )

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def run(self, batch: PaddedBatch) -> Any:
        self.batches.append(batch.lengths.tolist())
        if (batch.input_ids == POISON).any():
            raise RuntimeError("engine exploded")
        b, s = batch.input_ids.shape
        logits = np.full((b, s, 32), -10.0, dtype=np.float32)
        for row in range(b):
            for col in range(s):
                logits[row, col, (int(batch.input_ids[row, col]) + 1) % 32] = 10.0
        return logits


def make(policy: BatchPolicy, clock: Any = None) -> tuple[Scheduler, FakeEngine]:
    engine = FakeEngine()
    kwargs = {"clock": clock} if clock else {}
    return Scheduler(engine, policy, **kwargs), engine  # type: ignore[arg-type]


def results(futures: list[Future[JobResult]]) -> list[JobResult | BaseException]:
    out: list[JobResult | BaseException] = []
    for f in futures:
        exc = f.exception(timeout=10)
        out.append(exc if exc is not None else f.result())
    return out


def test_full_batches_and_results_sliced_per_request() -> None:
    sched, engine = make(BatchPolicy(4, 10_000, 1000, close_when_idle=False))
    futures = [sched.submit(Job([1, 2, i], OutputSpec(kind="next_token", top_k=2))) for i in range(4)]
    sched.start()
    done = results(futures)
    sched.stop()
    assert engine.batches == [[3, 3, 3, 3]]
    for i, r in enumerate(done):
        assert isinstance(r, JobResult) and r.top_ids is not None and r.top_ids[0] == i + 1
        assert r.batch_size == 4 and r.padded_tokens == 12


def test_a_failing_request_never_fails_its_neighbours() -> None:
    sched, engine = make(BatchPolicy(3, 10_000, 1000, close_when_idle=False))
    seen: list[BatchStats] = []
    sched.add_observer(seen.append)
    futures = [sched.submit(Job(ids, OutputSpec(kind="next_token"))) for ids in ([1], [POISON, 2], [5, 6])]
    sched.start()
    done = results(futures)
    sched.stop()
    assert isinstance(done[0], JobResult) and isinstance(done[2], JobResult)
    assert isinstance(done[1], RuntimeError)
    assert engine.batches[0] == [1, 2, 2] and sorted(engine.batches[1:]) == [[1], [2], [2]]
    assert [s.reason for s in seen] == ["isolate", "isolate"]


def test_expired_jobs_are_dropped_before_compute() -> None:
    now = [100.0]
    sched, engine = make(BatchPolicy(2, 0, 1000), clock=lambda: now[0])
    late = sched.submit(Job([1, 2], OutputSpec(kind="next_token"), deadline_s=99.0))
    fine = sched.submit(Job([3], OutputSpec(kind="next_token"), deadline_s=101.0))
    sched.start()
    done = results([late, fine])
    sched.stop()
    assert isinstance(done[0], RequestExpired) and isinstance(done[1], JobResult)
    assert engine.batches == [[1]]


def test_arrival_announcement_keeps_the_window_open_until_withdrawn() -> None:
    sched, engine = make(BatchPolicy(8, 10**9, 1000))  # a window that never closes here: only the withdrawal ends it
    with sched.arrival():  # a request is on its way but turns out bad: never submitted
        first = sched.submit(Job([1], OutputSpec(kind="next_token")))
        sched.start()
        with pytest.raises(TimeoutError):
            first.result(timeout=0.2)  # window held open for the announced arrival
    assert isinstance(first.result(timeout=10), JobResult)  # withdrawn → dispatched at once
    sched.stop()
    assert engine.batches == [[1]]


def test_stop_fails_late_submissions_cleanly() -> None:
    sched, _ = make(BatchPolicy(2, 0, 1000))
    sched.start()
    sched.stop()
    with pytest.raises(Exception, match="shutting down"):
        sched.submit(Job([1], OutputSpec(kind="next_token"))).result(timeout=1)


def test_a_request_is_on_its_way_until_its_thread_reaches_the_worker_s_code() -> None:
    """``unseen``: of the task IDs the worker holds, those whose thread has not announced itself yet (a
    pool thread still starting, Celery's tracer, the STARTED state being stored) count as on their way;
    finished IDs are forgotten."""
    sched, _ = make(BatchPolicy(8, 50, 1000))
    assert sched.unseen({"a", "b", "c"}) == 3
    with sched.arrival("a"):
        assert sched.unseen({"a", "b", "c"}) == 2
    sched.seen("b")  # a bulk message's task: its requests reach the scheduler together
    assert sched.unseen({"a", "b", "c"}) == 1
    assert sched.unseen({"c"}) == 1 and sched._seen == set()  # a and b finished: forgotten


def test_a_failing_backlog_count_never_stops_the_scheduler() -> None:
    """The backlog is counted from Celery's set of held requests, which the consumer's thread changes; a
    copy that met a change raised on the scheduler's thread and ended it, and every held request waited
    for ever (8 requests held for 120 s, the worker reported not ready). Now the count is 0 that once."""
    calls: list[int] = []

    def backlog() -> int:
        calls.append(1)
        raise RuntimeError("Set changed size during iteration")

    engine = FakeEngine()
    sched = Scheduler(engine, BatchPolicy(2, 10_000, 1000), backlog=backlog)  # type: ignore[arg-type]
    futures = [sched.submit(Job([1, i], OutputSpec(kind="next_token"))) for i in range(2)]
    sched.start()
    done = results(futures)
    sched.stop()
    assert all(isinstance(r, JobResult) for r in done) and calls


def test_copied_reads_a_set_that_changes_while_it_is_copied() -> None:
    class Changing:
        """Raises as a WeakSet does when another thread changes it mid-copy, its first ``changes`` times."""

        def __init__(self, changes: int) -> None:
            self.changes, self.tries = changes, 0

        def __iter__(self) -> Any:
            self.tries += 1
            if self.tries <= self.changes:
                raise RuntimeError("Set changed size during iteration")
            return iter(["a", "b"])

    once = Changing(1)
    assert copied(once) == ["a", "b"] and once.tries == 2
    always = Changing(10**9)
    assert copied(always) == [] and always.tries == 5  # read again at the next use
