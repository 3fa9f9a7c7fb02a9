"""The start-together wait on a real generation loop: a burst whose last messages are still in Redis.

A burst submitted one request at a time reaches an idle worker over milliseconds. Before, the wait for
company counted only what the worker already held (taken, still being decoded); the first request of
a burst whose other messages were still waiting in Redis found nothing "on its way", was prefilled
alone and decoded alone while the rest waited for its step (the 7.1 M same-weights bursts started in
2 to 3 groups). Now the scheduler also counts the messages waiting on the lists the worker takes from.

The Redis count is a function here, so each test decides what is waiting and waits on the scheduler's
own reads of it (events, never wall-clock windows).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from protocol.messages import GenerationParams
from tests.integration.multiturn import make_loop
from workers.generation.sequence import GenSequence
from workers.policy import BatchPolicy
from workers.scheduler import Scheduler

HOLD_S = 600.0
"""The wait's bound: never reached in these tests, so only the count decides when the burst starts."""


def _seq(i: int) -> GenSequence:
    return GenSequence(request_id=str(i), prompt=[3 + i, 9, 10], eos_ids=frozenset(),
                       params=GenerationParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, stream=False))


class WaitingInRedis:
    """What the scheduler's ``queued()`` reads: messages not yet handed to it; each read is recorded."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.reads = 0
        self.read = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self.reads += 1
            self.read.set()
            return self.count

    def hand_over(self) -> None:
        with self._lock:
            self.count -= 1
            self.read.clear()


def _scheduler(model_dir: Path, queued: object, batch: int, backlog: object = None) -> Scheduler:
    loop = make_loop(model_dir / "demo-llama" / "demo-llama-1.0.0.onnx", prefix_cache_bytes=0, max_batch_size=batch)
    return Scheduler(loop.decoder.engine, BatchPolicy(batch, 0, 16_384), generation=loop,  # type: ignore[arg-type]
                     start_together_s=HOLD_S, queued=queued, backlog=backlog)  # type: ignore[arg-type]


def test_a_burst_still_waiting_in_redis_starts_together(model_dir: Path) -> None:
    waiting = WaitingInRedis(3)
    sched = _scheduler(model_dir, waiting, batch=4)
    sched.start()
    try:
        seqs = [_seq(i) for i in range(4)]
        futures = [sched.submit_generation(seqs[0])]
        for seq in seqs[1:]:
            assert waiting.read.wait(30), "the scheduler never counted what waits in Redis"
            assert not futures[0].done() and seqs[0].prefill_batch == 0  # held: three are still in Redis
            waiting.hand_over()
            futures.append(sched.submit_generation(seq))
        outcomes = [f.result(timeout=60) for f in futures]
    finally:
        sched.stop()
    assert [o.batch_size_min for o in outcomes] == [4] * 4  # all four from the first step
    assert waiting.reads >= 3


def test_nothing_waiting_in_redis_starts_a_lone_request_at_once(model_dir: Path) -> None:
    waiting = WaitingInRedis(0)
    sched = _scheduler(model_dir, waiting, batch=4)
    sched.start()
    try:
        outcome = sched.submit_generation(_seq(0)).result(timeout=60)  # a 600 s hold would time out
    finally:
        sched.stop()
    assert outcome.batch_size_max == 1 and waiting.reads >= 1


@pytest.mark.parametrize("failing", ["queued", "backlog"])
def test_a_failing_count_starts_the_burst_and_the_scheduler_lives(
    model_dir: Path, caplog: pytest.LogCaptureFixture, failing: str
) -> None:
    """Either count the start-together wait reads (messages in Redis, requests on their way) may raise: the
    burst starts, the scheduler lives, and the failure is logged once per outage, not at every decision."""
    reads: list[int] = []

    def down() -> int:
        reads.append(1)
        raise ConnectionError("Redis is down")

    sched = _scheduler(model_dir, down if failing == "queued" else WaitingInRedis(0), batch=4,
                       backlog=down if failing == "backlog" else None)  # fmt: skip
    sched.start()
    try:
        with caplog.at_level(logging.WARNING, logger="fleet.scheduler"):
            first = sched.submit_generation(_seq(0)).result(timeout=60)
            second = sched.submit_generation(_seq(1)).result(timeout=60)
    finally:
        sched.stop()
    assert first.batch_size_max == 1 and len(second.token_ids) == 6 and len(reads) >= 2
    what = "messages waiting in Redis" if failing == "queued" else "requests on their way to the scheduler"
    warnings = [r for r in caplog.records if f"the count of {what} failed (ConnectionError: Redis is down)"
                in r.getMessage()]  # fmt: skip
    assert len(warnings) == 1  # once per outage, not at every decision
    assert bool(warnings[0].exc_info) == (failing == "backlog")  # a local count failing is a bug: traced


def test_a_full_batch_never_waits_for_more(model_dir: Path) -> None:
    waiting = WaitingInRedis(50)  # a backlog the worker cannot take into this batch
    sched = _scheduler(model_dir, waiting, batch=2)
    sched.start()
    try:
        seqs = [_seq(0), _seq(1)]
        first = sched.submit_generation(seqs[0])
        assert waiting.read.wait(30)
        second = sched.submit_generation(seqs[1])
        outcomes = [first.result(timeout=60), second.result(timeout=60)]
    finally:
        sched.stop()
    assert [o.batch_size_min for o in outcomes] == [2, 2]
