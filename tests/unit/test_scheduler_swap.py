"""Engine swap between batches: roles, fallbacks and versions (fake engines; no ORT, no Redis)."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import numpy as np

from protocol.messages import GenerationParams, OutputSpec
from protocol.modelcard import ModelCard
from workers.generation.sequence import GenSequence
from workers.padding import PaddedBatch
from workers.policy import BatchPolicy
from workers.scheduler import Job, JobOutcome, JobResult, Scheduler

CARD = ModelCard(name="fake", version="0", kind="causal_lm", vocab_size=32, max_positions=64, num_layers=1,
                 num_heads=1, head_dim=1, hidden_size=1)


class ShiftEngine:
    """Top-1 = (last token + shift) % 32, so a result shows which engine computed it; can block or fail."""

    card = CARD

    def __init__(self, shift: int, fail: bool = False) -> None:
        self.shift = shift
        self.fail = fail
        self.batches: list[int] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def run(self, batch: PaddedBatch) -> Any:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.batches.append(len(batch.lengths))
        if self.fail:
            raise RuntimeError("canary exploded")
        b, s = batch.input_ids.shape
        logits = np.zeros((b, s, 32), dtype=np.float32)
        for row in range(b):
            for col in range(s):
                logits[row, col, (int(batch.input_ids[row, col]) + self.shift) % 32] = 10.0
        return logits


def job(token: int, role: str = "stable") -> Job:
    return Job([token], OutputSpec(kind="next_token", top_k=1), role=role, submitted_unix_s=None)  # type: ignore[arg-type]


def done(j: Job) -> JobResult:
    return j.future.result(timeout=10)


def test_a_batch_never_mixes_engines_and_canary_jobs_fall_back_to_stable() -> None:
    stable, canary = ShiftEngine(1), ShiftEngine(2)
    sched = Scheduler(stable, BatchPolicy(8, 50, 1000, close_when_idle=False), version="v1")  # type: ignore[arg-type]
    outcomes: list[JobOutcome] = []
    sched.add_outcome_observer(outcomes.extend)
    sched.swap("canary", canary, "v2")  # type: ignore[arg-type]
    jobs = [job(t, "canary" if t % 2 else "stable") for t in range(1, 9)]
    for j in jobs:
        sched.submit(j)
    sched.start()
    results = [done(j) for j in jobs]
    for j, r in zip(jobs, results, strict=True):
        expected = ("v2", "canary", 2) if j.role == "canary" else ("v1", "stable", 1)
        assert (r.version, r.role, r.top_ids[0] if r.top_ids else None) == (*expected[:2], j.input_ids[0] + expected[2])
    assert sum(stable.batches) == 4 and sum(canary.batches) == 4  # split by engine, none mixed

    sched.swap("canary", None, "")  # the canary is dropped: canary-role jobs run on stable
    late = job(5, "canary")
    sched.submit(late)
    assert (done(late).version, done(late).role, done(late).top_ids) == ("v1", "stable", [6])
    sched.stop()
    assert [(o.version, o.role, o.ok) for o in outcomes].count(("v2", "canary", True)) == 4
    assert len(outcomes) == 9
    # the late canary-queue job ran on stable: its outcome says so, and that its queue was the canary's
    assert sorted((o.version, o.role, o.asked) for o in outcomes) == sorted(
        [("v2", "canary", "canary")] * 4 + [("v1", "stable", "stable")] * 4 + [("v1", "stable", "canary")])


def test_a_swap_takes_effect_at_the_next_batch_and_the_old_engine_is_freed_after_its_last_batch() -> None:
    old, new = ShiftEngine(1), ShiftEngine(3)
    gate, entered = threading.Event(), old.entered
    old.gate = gate
    old_ref = weakref.ref(old)
    sched = Scheduler(old, BatchPolicy(1, 0, 1000, close_when_idle=True), version="v1")  # type: ignore[arg-type]
    del old
    sched.start()
    first = job(4)
    sched.submit(first)
    assert entered.wait(10)
    sched.swap("stable", new, "v2")  # type: ignore[arg-type]
    second = job(4)
    sched.submit(second)
    assert old_ref() is not None  # the running batch still holds it
    gate.set()
    assert (done(first).version, done(first).top_ids) == ("v1", [5])
    assert (done(second).version, done(second).top_ids) == ("v2", [7])
    gc.collect()
    assert old_ref() is None  # its last batch ended: nothing holds the old engine (its ORT session) any more
    sched.stop()


def test_failed_canary_requests_are_reported_as_failed_outcomes() -> None:
    sched = Scheduler(ShiftEngine(1), BatchPolicy(4, 10_000, 1000, close_when_idle=False), version="v1")  # type: ignore[arg-type]
    sched.swap("canary", ShiftEngine(2, fail=True), "bad")  # type: ignore[arg-type]
    outcomes: list[JobOutcome] = []
    sched.add_outcome_observer(outcomes.extend)
    jobs = [job(t, "canary") for t in range(4)]
    for j in jobs:
        sched.submit(j)
    sched.start()
    for j in jobs:
        assert isinstance(j.future.exception(timeout=10), RuntimeError)
    sched.stop()
    assert [(o.version, o.role, o.ok) for o in outcomes] == [("bad", "canary", False)] * 4


class FakeLoop:
    """A generation loop whose sequences finish after ``steps`` steps with the loop's name as result;
    its first step waits for ``release`` (so a test can swap while a sequence runs)."""

    def __init__(self, name: str, steps: int = 2) -> None:
        self.name = name
        self.steps = steps
        self.running: dict[GenSequence, int] = {}
        self.joined: list[str] = []
        self.admitted = threading.Event()
        self.release = threading.Event()
        self.observers: list[Any] = []

    @property
    def active(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running)

    def admissible(self, waiting: list[GenSequence]) -> int:
        return len(waiting)

    def step(self, joiners: list[GenSequence]) -> None:
        for seq in joiners:
            self.running[seq] = self.steps
            self.joined.append(seq.request_id)
        if joiners:
            self.admitted.set()
            self.release.wait(10)
        for seq in list(self.running):
            self.running[seq] -= 1
            if self.running[seq] == 0:
                del self.running[seq]
                seq.future.set_result(self.name)  # type: ignore[arg-type]

    def fail_all(self, exc: BaseException) -> None:
        for seq in self.running:
            seq.future.set_exception(exc)
        self.running.clear()


def seq(rid: str) -> GenSequence:
    return GenSequence(request_id=rid, prompt=[1, 2], params=GenerationParams(), eos_ids=frozenset())


def test_running_generations_finish_on_the_old_loop_and_new_ones_join_the_new_one() -> None:
    old, new = FakeLoop("old"), FakeLoop("new")
    new.release.set()
    sched = Scheduler(ShiftEngine(1), BatchPolicy(4, 50, 1000), generation=old, version="v1")  # type: ignore[arg-type]
    sched.start()
    first = seq("first")
    sched.submit_generation(first)
    assert old.admitted.wait(10)
    sched.swap("stable", ShiftEngine(2), "v2", new)  # type: ignore[arg-type]
    second = seq("second")
    sched.submit_generation(second)
    old.release.set()
    assert first.future.result(timeout=10) == "old" and second.future.result(timeout=10) == "new"
    assert (first.served_version, second.served_version) == ("v1", "v2")
    assert old.joined == ["first"] and new.joined == ["second"]
    sched.stop()


def test_canary_generations_join_the_canary_loop_and_are_reported_as_outcomes() -> None:
    stable, canary = FakeLoop("stable"), FakeLoop("canary")
    stable.release.set()
    sched = Scheduler(ShiftEngine(1), BatchPolicy(4, 50, 1000), generation=stable, version="v1")  # type: ignore[arg-type]
    outcomes: list[JobOutcome] = []
    sched.add_outcome_observer(outcomes.extend)
    sched.swap("canary", ShiftEngine(2), "v2", canary)  # type: ignore[arg-type]
    sched.start()
    on_canary = seq("on-canary")
    on_canary.role = "canary"
    sched.submit_generation(on_canary)
    assert canary.admitted.wait(10)
    sched.swap("canary", None, "")  # dropped while it runs: it finishes there; later canary ones go to stable
    later = seq("later")
    later.role = "canary"
    sched.submit_generation(later)
    canary.release.set()
    assert on_canary.future.result(timeout=10) == "canary" and later.future.result(timeout=10) == "stable"
    assert (on_canary.served_version, on_canary.served_role) == ("v2", "canary")
    assert (later.served_version, later.served_role) == ("v1", "stable")
    sched.stop()
    assert sorted((o.version, o.role, o.ok) for o in outcomes) == [("v1", "stable", True), ("v2", "canary", True)]
