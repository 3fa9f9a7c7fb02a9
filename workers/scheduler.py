"""The scheduler: one thread that forms batches, runs the engine and resolves each request's future.

Task threads (one per held request, i.e. per token of the worker's bucket) hand a :class:`Job` to
:meth:`Scheduler.submit` and block on its future. The scheduler thread asks the pure
:class:`~workers.policy.BatchPolicy` what to do, pads the chosen jobs, runs one engine step and
slices each job's result back out. ``InferenceSession.run`` releases the GIL, so the next batch
gathers while the current one computes.

Every job is a sequence that needs one or more engine steps. One-step jobs (next-token top-k,
embeddings) are :class:`Job` s batched by the policy. Generations are
:class:`~workers.generation.sequence.GenSequence` s that stay for many steps: between one-step
batches the loop runs one :class:`~workers.generation.loop.GenerationLoop` step (admit joiners,
prefill them, one decode step for everyone running), so new sequences join between decode steps.
Observers (metrics) subscribe with :meth:`Scheduler.add_observer`; the loop itself knows nothing of them.
A one-step job cancelled while it waits for its batch (:meth:`Scheduler.cancel`, from the worker's cancel
listener: :mod:`workers.cancel_watch`) leaves the window unrun; once its batch has formed, its result wins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from protocol.errors import FleetError, RequestCancelled, RequestExpired
from protocol.messages import OutputSpec
from workers.count_or_zero import CountOrZero
from workers.engine import Engine
from workers.generation.loop import GenerationLoop
from workers.generation.sequence import GenOutcome, GenSequence
from workers.padding import PaddedBatch, pad_batch
from workers.policy import BatchPolicy, Dispatch, Pending, Wait
from workers.postprocess import last_positions, pool, top_k_logprobs

__all__ = ["Arrival", "BatchStats", "Job", "JobOutcome", "JobResult", "Role", "Scheduler", "Served"]

log = logging.getLogger("fleet.scheduler")


Role = Literal["stable", "canary"]


@dataclass(frozen=True)
class JobResult:
    """One request's share of a batch."""

    top_ids: list[int] | None
    top_logprobs: list[float] | None
    embedding: list[float] | None
    batch_size: int
    padded_tokens: int
    batch_wait_ms: float
    inference_ms: float
    batch_started_unix_s: float
    version: str = ""
    """The model version that computed this result."""
    role: Role = "stable"
    """The role of the engine that computed it (a canary-queue job runs on stable when no canary is loaded)."""


@dataclass(frozen=True)
class Served:
    """One loaded engine, the version it holds and its role; batches capture it at their start."""

    engine: Engine
    version: str
    role: Role
    since_unix_s: float = 0.0
    """When it started serving its role (wall clock, s; set under the scheduler's lock, so every batch
    formed on it has ``batch_started_unix_s`` >= this, and every batch formed before has less)."""


@dataclass(frozen=True)
class JobOutcome:
    """How one job of a batch ended, for the per-version outcome stream."""

    version: str
    role: Role
    ok: bool
    submitted_unix_s: float | None
    """The producer's submit time (wall clock, s); None when the request did not carry it."""
    asked: Role = "stable"
    """The role the request asked for (its queue's): ``canary`` with ``role`` stable is a canary-queue
    request computed by stable, no canary being loaded (what the guard's unserved-canary check counts)."""


@dataclass
class Job:
    """One sequence waiting for the engine."""

    input_ids: list[int]
    output: OutputSpec
    deadline_s: float | None = None
    """Monotonic deadline (s); past it the job is dropped before compute."""
    arrived_s: float = 0.0
    future: Future[JobResult] = field(default_factory=Future)
    role: Role = "stable"
    """Which engine the request asked for (its queue's role); canary falls back to stable."""
    submitted_unix_s: float | None = None
    request_id: str = ""
    """The request it serves (its Celery task ID), named in a cancel's error; '' for unnamed jobs."""
    handed_over: bool = field(default=False, init=False, repr=False)
    """Set (under the scheduler's lock) once the scheduler has it: pending, then in a batch."""
    cancelled: bool = field(default=False, init=False, repr=False)
    """Cancelled before it was handed over (:meth:`Scheduler.cancel`): refused when it is."""


@dataclass(frozen=True)
class BatchStats:
    """What observers learn about each batch."""

    size: int
    real_tokens: int
    padded_tokens: int
    inference_ms: float
    reason: str
    expired: int
    version: str = ""
    """The model version the batch ran on."""


Observer = Callable[[BatchStats], None]
OutcomeObserver = Callable[[list[JobOutcome]], None]
_Output = tuple[list[int] | None, list[float] | None, list[float] | None]


class Arrival:
    """A task thread's promise that a job is on its way; see :meth:`Scheduler.arrival`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self.submitted = False

    def submit(self, job: Job) -> Future[JobResult]:
        """Hand ``job`` to the scheduler; returns its future."""
        self.submitted = True
        return self._scheduler._enqueue(job, was_arriving=True)

    def submit_generation(self, seq: GenSequence) -> Future[GenOutcome]:
        """Hand a generation to the scheduler; returns its future."""
        self.submitted = True
        return self._scheduler.submit_generation(seq, was_arriving=True)


class Scheduler:
    """Owns the pending list and the engine thread."""

    def __init__(
        self,
        engine: Engine,
        policy: BatchPolicy,
        clock: Callable[[], float] = time.monotonic,
        backlog: Callable[[], int] | None = None,
        generation: GenerationLoop | None = None,
        version: str = "",
        start_together_s: float = 0.0,
        queued: Callable[[], int] | None = None,
    ) -> None:
        """``backlog()`` counts requests the worker has received but whose threads have not reached its
        code yet (:meth:`unseen` of Celery's held task IDs: not started, or still in Celery's tracer);
        like announced arrivals, they keep the window open.
        ``start_together_s``: while no generation runs, how long the first waiting one waits for those
        on their way (``batching.start_together_ms``), so a burst is prefilled together. ``queued()``
        counts the messages still waiting in Redis on the lists this worker takes from (one round trip);
        it is read only for that wait, once nothing the worker holds is on its way: a burst whose last
        messages the worker has not taken yet still starts together.
        ``generation`` serves generate jobs (None: the model cannot generate). ``engine`` is the
        stable engine holding model ``version``; :meth:`swap` replaces it or sets a canary."""
        self._stable = Served(engine, version, "stable", time.time())
        self._canary: Served | None = None
        self._canary_generation: GenerationLoop | None = None
        self._retiring: list[GenerationLoop] = []
        self._gen_live: list[GenSequence] = []
        """Generations admitted to a loop and not yet reported to the outcome observers."""
        self._outcome_observers: list[OutcomeObserver] = []
        self._on_their_way = CountOrZero(backlog or (lambda: 0), "the count of requests on their way to the scheduler",
                                         "a wait for company ends early", traceback=True)  # a local count: a bug
        self._queued_in_redis = CountOrZero(queued or (lambda: 0), "the count of messages waiting in Redis",
                                            "bursts start without them")
        self.start_together_s = start_together_s
        self.policy = policy
        self.clock = clock
        self._cond = threading.Condition()
        self._pending: list[Job] = []
        self.generation = generation
        self._gen_waiting: list[GenSequence] = []
        self._arriving = 0
        self._seen: set[str] = set()
        """Celery task IDs whose threads reached this worker's code (:meth:`unseen`)."""
        self._stopping = False
        self._observers: list[Observer] = []
        self._thread = threading.Thread(target=self._loop, name="fleet-scheduler", daemon=True)
        self.batches_run = 0

    def add_observer(self, observer: Observer) -> None:
        """Call ``observer(stats)`` after every batch (from the scheduler thread; keep it cheap)."""
        self._observers.append(observer)

    def add_outcome_observer(self, observer: OutcomeObserver) -> None:
        """Call ``observer(outcomes)`` once per batch with every job's outcome, failures included."""
        self._outcome_observers.append(observer)

    @property
    def engine(self) -> Engine:
        """The stable engine (the one a new batch of the stable role runs on)."""
        return self._stable.engine

    @property
    def stable(self) -> Served:
        """The stable engine and its version."""
        return self._stable

    @property
    def canary(self) -> Served | None:
        """The canary engine and its version; None when no canary is loaded."""
        return self._canary

    def swap(
        self, role: Role, engine: Engine | None, version: str, generation: GenerationLoop | None = None
    ) -> None:
        """Serve ``role`` with ``engine`` (model ``version``) from the next batch on.

        A batch already running keeps the engine it captured at its start; the old engine is freed
        when the last reference (that batch) ends. ``engine=None`` for the canary role drops the
        canary (its queued requests then run on stable). ``generation`` is the new engine's
        generation loop (None: it cannot generate): sequences already running finish on the old loop
        (stepped until it is empty); new sequences join the new one.
        """
        with self._cond:
            if role == "canary":
                self._canary = None if engine is None else Served(engine, version, "canary", time.time())
                old_canary = self._canary_generation
                if old_canary is not None and old_canary is not generation:
                    self._retiring.append(old_canary)  # kept (and stepped) while it has running sequences
                self._canary_generation = generation if engine is not None else None
            else:
                if engine is None:
                    raise ValueError("the stable role always has an engine")
                self._stable = Served(engine, version, "stable", time.time())
                old = self.generation
                if old is not None and old is not generation:
                    self._retiring.append(old)  # kept (and stepped) while it has running sequences
                self.generation = generation
            self._cond.notify_all()

    def _served_for(self, role: Role) -> Served:
        """The engine a job of ``role`` runs on now (caller holds the lock)."""
        if role == "canary" and self._canary is not None:
            return self._canary
        return self._stable

    def _loops(self) -> list[tuple[GenerationLoop, Served]]:
        """The generation loops new sequences may join, with the engine of each (caller holds the lock)."""
        loops = [] if self.generation is None else [(self.generation, self._stable)]
        if self._canary_generation is not None and self._canary is not None:
            loops.append((self._canary_generation, self._canary))
        return loops

    def _admit(self) -> list[tuple[GenerationLoop, list[GenSequence]]]:
        """Each joinable loop with the waiting sequences it admits now (caller holds the lock).

        A canary-role sequence joins the canary's loop when one is loaded, else the stable loop.
        """
        work: list[tuple[GenerationLoop, list[GenSequence]]] = []
        canary_loop = self._canary_generation if self._canary is not None else None
        for loop, served in self._loops():
            mine = [
                q for q in self._gen_waiting
                if (q.role == "canary" and canary_loop is not None) == (loop is canary_loop)
            ]
            joiners = mine[: loop.admissible(mine)] if mine else []
            for seq in joiners:
                seq.served_version, seq.served_role = served.version, served.role
            if joiners:
                taken = set(map(id, joiners))
                self._gen_waiting = [q for q in self._gen_waiting if id(q) not in taken]
                self._gen_live.extend(joiners)
            work.append((loop, joiners))
        return work

    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish pending jobs, then stop the thread (waits up to ``timeout_s``)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    @property
    def pending_count(self) -> int:
        """Jobs waiting for a batch."""
        with self._cond:
            return len(self._pending)

    def wake(self) -> None:
        """Have the scheduler thread decide again now: something it waits on changed (a count of company
        on its way dropped)."""
        with self._cond:
            self._cond.notify_all()

    def seen(self, task_id: str) -> None:
        """Note that the thread of Celery task ``task_id`` has reached this worker's code (see
        :meth:`unseen`): it is no longer on its way, it is announced or handled."""
        with self._cond:
            self._seen.add(task_id)

    def unseen(self, held: set[str]) -> int:
        """How many of ``held`` (the Celery task IDs the worker has received and not finished) have not
        reached this worker's code yet: taken from Redis, queued for a pool thread, or in Celery's
        tracer before the task body. IDs no longer held are forgotten."""
        with self._cond:
            self._seen &= held
            return len(held - self._seen)

    @contextmanager
    def arrival(self, task_id: str | None = None) -> Iterator[Arrival]:
        """Announce a job while the task thread decodes and validates it (``task_id``: its Celery task).

        While any announced job has not been submitted, the policy knows company is on its way.
        Leaving the block without submitting (a bad request) withdraws the announcement.
        """
        with self._cond:
            if task_id is not None:
                self._seen.add(task_id)
            self._arriving += 1
        handle = Arrival(self)
        try:
            yield handle
        finally:
            if not handle.submitted:
                with self._cond:
                    self._arriving -= 1
                    self._cond.notify_all()

    def submit(self, job: Job) -> Future[JobResult]:
        """Hand ``job`` to the scheduler without an announcement; returns its future."""
        return self._enqueue(job, was_arriving=False)

    def submit_generation(self, seq: GenSequence, *, was_arriving: bool = False) -> Future[GenOutcome]:
        """Queue a generation; it joins the running batch at a coming step. Returns its future."""
        with self._cond:
            if self._stopping or self.generation is None:
                why = "worker is shutting down" if self._stopping else "this model cannot generate"
                seq.future.set_exception(FleetError(why, "worker", None))
            else:
                seq.arrived_s = self.clock()
                self._gen_waiting.append(seq)
            if was_arriving:
                self._arriving -= 1
            self._cond.notify_all()
        return seq.future

    @property
    def generating(self) -> int:
        """Generations waiting to join or running."""
        with self._cond:
            loops = [self.generation, self._canary_generation, *self._retiring]
            return len(self._gen_waiting) + sum(loop.active for loop in loops if loop is not None)

    def submit_many(self, jobs: list[Job]) -> None:
        """Hand several jobs over at once, so the policy sees them together (bulk messages)."""
        with self._cond:
            now = self.clock()
            for job in jobs:
                if self._stopping:
                    job.future.set_exception(FleetError("worker is shutting down", "worker", None))
                    continue
                self._take_over(job, now)
            self._cond.notify_all()

    def cancel(self, job: Job) -> bool:
        """End ``job`` with :class:`~protocol.errors.RequestCancelled` unless its batch has formed.

        A job waiting for its batch leaves the window now, without running; the jobs around it are
        untouched (the policy decides again without it). A job not handed over yet (a bulk message's,
        before :meth:`submit_many`) is refused when it is. Returns False, and changes nothing, once the job
        is in a batch (running or done): an engine step cannot be stopped part way, its result wins.
        """
        with self._cond:
            if not job.handed_over:
                job.cancelled = True
                return True
            at = next((i for i, pending in enumerate(self._pending) if pending is job), None)
            if at is None:
                return False
            del self._pending[at]
            self._cond.notify_all()
        job.future.set_exception(RequestCancelled.before_run(job.request_id))
        return True

    def _take_over(self, job: Job, now: float) -> None:
        """Hand ``job`` to the scheduler (the caller holds the lock): pending from ``now`` (clock s), or refused
        at once when it was cancelled before (:meth:`cancel`)."""
        job.handed_over = True
        if job.cancelled:
            job.future.set_exception(RequestCancelled.before_run(job.request_id))
            return
        job.arrived_s = now
        self._pending.append(job)

    def _enqueue(self, job: Job, *, was_arriving: bool) -> Future[JobResult]:
        with self._cond:
            if self._stopping:
                job.future.set_exception(FleetError("worker is shutting down", "worker", None))
                return job.future
            self._take_over(job, self.clock())
            if was_arriving:
                self._arriving -= 1
            self._cond.notify_all()
        return job.future

    def _next_work(
        self,
    ) -> tuple[list[Job], str, Served | None, float, list[tuple[GenerationLoop, list[GenSequence]]]] | None:
        """The next one-step batch (maybe empty) with the engine it runs on and when it was formed
        (wall clock, s: its ``batch_started_unix_s``), and each generation loop with the sequences
        joining it at the next step (taken under the lock, so a swap never moves joiners to another loop).

        A batch never mixes engines: it takes, of the jobs the policy dispatches, those that run on
        the same engine as the oldest; the others stay pending for the next batch.
        Blocks only while there is nothing to do: a running generation means a step is due now.
        """
        with self._cond:
            while True:
                loops = [loop for loop, _ in self._loops()]
                self._retiring = [loop for loop in self._retiring if loop.has_work()]
                running = any(loop.has_work() for loop in loops) or bool(self._retiring)
                gen_busy = running or (bool(loops) and bool(self._gen_waiting))
                if self._stopping and not self._pending and not gen_busy:
                    return None
                on_the_way = 0 if self._stopping else self._arriving + self._on_their_way()
                decision = self.policy.decide(
                    self.clock(), [Pending(j.arrived_s, len(j.input_ids)) for j in self._pending], on_the_way
                )
                batch: list[Job] = []
                reason = ""
                served: Served | None = None
                formed_unix_s = 0.0
                if isinstance(decision, Dispatch):
                    formed_unix_s = time.time()
                    served = self._served_for(self._pending[0].role)
                    chosen = self._pending[: decision.count]
                    batch = [j for j in chosen if self._served_for(j.role) is served]
                    self._pending = [j for j in chosen if self._served_for(j.role) is not served] + self._pending[
                        decision.count :
                    ]
                    reason = decision.reason
                hold_until = self._start_together_until(running, on_the_way)
                admit = self._gen_waiting and hold_until is None
                gen_work = self._admit() if admit else [(loop, []) for loop in loops]
                if batch or running or any(joiners for _, joiners in gen_work):
                    return batch, reason, served, formed_unix_s, gen_work
                until = [u for u in (decision.until_s if isinstance(decision, Wait) else None, hold_until)
                         if u is not None]  # fmt: skip
                self._cond.wait(max(0.0, min(until) - self.clock()) if until else None)

    def _start_together_until(self, running: bool, on_the_way: int) -> float | None:
        """When the waiting generations should start (clock s) if they are held for company, else None.

        Held only while no sequence runs (a running batch takes joiners at its next step anyway), while
        fewer than a full batch wait, and only while company is on its way to the scheduler: requests
        the worker holds, or (read only when there are none) messages still waiting in Redis on the
        lists it takes from. A lone request never waits, and a burst starts the moment its last request
        arrives (caller holds the lock).
        """
        if running or not self._gen_waiting or self.start_together_s <= 0:
            return None
        if len(self._gen_waiting) >= self.policy.max_batch_size:
            return None
        until = self._gen_waiting[0].arrived_s + self.start_together_s
        if self.clock() >= until:
            return None
        if on_the_way <= 0 and self._queued_in_redis() <= 0:
            return None
        return until

    def _loop(self) -> None:
        while True:
            nxt = self._next_work()
            if nxt is None:
                return
            batch, reason, served, formed_unix_s, gen_work = nxt
            if batch and served is not None:
                try:
                    self._run(batch, reason, served, formed_unix_s)
                except Exception as exc:  # never let one batch kill the thread
                    log.exception("batch failed unexpectedly")
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(exc)
            current = [loop for loop, _ in gen_work]
            for old in list(self._retiring):  # sequences started on a swapped-out engine finish there
                if old not in current:
                    self._step_generation(old, [])
            for loop, joiners in gen_work:
                if joiners or loop.has_work():
                    self._step_generation(loop, joiners)
            if self._gen_live:
                self._report_generations()

    @staticmethod
    def _step_generation(loop: GenerationLoop, joiners: list[GenSequence]) -> None:
        try:
            loop.step(joiners)
        except Exception as exc:  # an engine failure ends the running generations, not the worker
            log.exception("generation step failed")
            for seq in joiners:
                if not seq.future.done():
                    seq.future.set_exception(exc)
            loop.fail_all(exc)

    def _run(self, batch: list[Job], reason: str, served: Served, formed_unix_s: float) -> None:
        now = self.clock()
        live: list[Job] = []
        for job in batch:
            if job.deadline_s is not None and now > job.deadline_s:
                job.future.set_exception(
                    RequestExpired(
                        f"deadline passed {1000 * (now - job.deadline_s):.0f} ms before compute; not run",
                        "deadline_unix_s",
                        None,
                    )
                )
            else:
                live.append(job)
        if not live:
            return
        try:
            self._compute(live, reason, len(batch) - len(live), served, formed_unix_s)
        except Exception as exc:
            if len(live) == 1:
                live[0].future.set_exception(exc)
            else:
                # One request must never fail its neighbours: retry each alone.
                log.warning("batch of %d failed (%s); retrying each request alone", len(live), exc)
                for job in live:
                    try:
                        self._compute([job], "isolate", 0, served, formed_unix_s)
                    except Exception as single_exc:
                        job.future.set_exception(single_exc)
        self._report_outcomes(live, served)

    def _report_generations(self) -> None:
        """Hand the generations that ended since the last step to the outcome observers (one call)."""
        ended = [q for q in self._gen_live if q.future.done()]
        if not ended:
            return
        self._gen_live = [q for q in self._gen_live if not q.future.done()]
        outcomes = [
            JobOutcome(q.served_version, q.served_role, q.future.exception() is None, q.submitted_unix_s, q.role)
            for q in ended
        ]
        for observer in self._outcome_observers:
            try:
                observer(outcomes)
            except Exception:
                log.exception("outcome observer failed")

    def _report_outcomes(self, jobs: list[Job], served: Served) -> None:
        if not self._outcome_observers:
            return
        outcomes = [
            JobOutcome(served.version, served.role, job.future.exception() is None, job.submitted_unix_s, job.role)
            for job in jobs
        ]
        for observer in self._outcome_observers:
            try:
                observer(outcomes)
            except Exception:
                log.exception("outcome observer failed")

    def _outputs(
        self, engine: Engine, jobs: list[Job], out: npt.NDArray[np.float32], padded: PaddedBatch
    ) -> list[_Output]:
        """Each job's small result from the batch's raw output (top-k or pooled vector)."""
        if engine.card.kind == "causal_lm":
            ids, logprobs = top_k_logprobs(last_positions(out, padded.lengths), max(j.output.top_k for j in jobs))
            return [
                (ids[row, : j.output.top_k].tolist(), logprobs[row, : j.output.top_k].tolist(), None)
                for row, j in enumerate(jobs)
            ]
        pooled = pool(out, padded.attention_mask, engine.pooling)
        results: list[_Output] = []
        for row, job in enumerate(jobs):
            vec = pooled[row]
            if job.output.normalize and not engine.pooling.normalize:
                vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
            results.append((None, None, vec.astype(np.float32).tolist()))
        return results

    def _compute(self, jobs: list[Job], reason: str, expired: int, served: Served, formed_unix_s: float) -> None:
        engine = served.engine
        started_unix = formed_unix_s
        start = self.clock()
        padded = pad_batch([j.input_ids for j in jobs], engine.card.pad_token_id)
        out = engine.run(padded)
        inference_ms = (self.clock() - start) * 1000
        self.batches_run += 1
        outputs = self._outputs(engine, jobs, out, padded)
        for job, (top_ids, top_logprobs, embedding) in zip(jobs, outputs, strict=True):
            job.future.set_result(
                JobResult(
                    top_ids=top_ids,
                    top_logprobs=top_logprobs,
                    embedding=embedding,
                    batch_size=len(jobs),
                    padded_tokens=padded.padded_tokens,
                    batch_wait_ms=(start - job.arrived_s) * 1000,
                    inference_ms=inference_ms,
                    batch_started_unix_s=started_unix,
                    version=served.version,
                    role=served.role,
                )
            )
        stats = BatchStats(
            len(jobs), padded.real_tokens, padded.padded_tokens, inference_ms, reason, expired, served.version
        )
        for observer in self._observers:
            try:
                observer(stats)
            except Exception:
                log.exception("batch observer failed")
