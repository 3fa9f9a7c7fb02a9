"""The scheduler: one thread that forms batches, runs the engine and resolves each request's future.

Task threads (one per held request, i.e. per token of the worker's bucket) hand a :class:`Job` to
:meth:`Scheduler.submit` and block on its future. The scheduler thread asks the pure
:class:`~workers.policy.BatchPolicy` what to do and hands the chosen jobs to a
:class:`~workers.batch_runner.BatchRunner`, which pads them, runs one engine step and slices each job's
result back out. ``InferenceSession.run`` releases the GIL, so the next batch gathers while the current
one computes.

Every job is a sequence that needs one or more engine steps. One-step jobs (next-token top-k,
embeddings) are :class:`Job` s batched by the policy. Generations are
:class:`~workers.generation.sequence.GenSequence` s that stay for many steps: between one-step
batches the loop runs one :class:`~workers.generation.loop.GenerationLoop` step (admit joiners,
prefill them, one decode step for everyone running), so new sequences join between decode steps; the
loops, and the sequences waiting for them, are a :class:`~workers.generation_loops.GenerationLoops`.
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

from protocol.errors import FleetError, RequestCancelled
from workers.batch_runner import BatchRunner
from workers.count_or_zero import CountOrZero
from workers.engine import Engine
from workers.generation.loop import GenerationLoop
from workers.generation.sequence import GenOutcome, GenSequence
from workers.generation_loops import GenerationLoops, GenWork
from workers.jobs import BatchStats, Job, JobOutcome, JobResult, Observer, OutcomeObserver, Role, Served
from workers.policy import BatchPolicy, Dispatch, Pending, Wait

# The job types live in workers.jobs; named here too, so `from workers.scheduler import Job` keeps working.
__all__ = ["Arrival", "BatchStats", "Job", "JobOutcome", "JobResult", "Role", "Scheduler", "Served"]

log = logging.getLogger("fleet.scheduler")


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
        self._gen = GenerationLoops(generation)
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
        self._arriving = 0
        self._seen: set[str] = set()
        """Celery task IDs whose threads reached this worker's code (:meth:`unseen`)."""
        self._stopping = False
        self._observers: list[Observer] = []
        self._thread = threading.Thread(target=self._run, name="fleet-scheduler", daemon=True)
        self._batches = BatchRunner(clock, self._observers, self._outcome_observers)
        self.on_death: list[Callable[[], None]] = []
        """Called (on the dying thread) when the scheduler thread ends on an exception it did not catch: no
        request is computed from then on (the worker's readiness, :mod:`workers.progress`)."""

    def add_observer(self, observer: Observer) -> None:
        """Call ``observer(stats)`` after every batch (from the scheduler thread; keep it cheap)."""
        self._observers.append(observer)

    def add_outcome_observer(self, observer: OutcomeObserver) -> None:
        """Call ``observer(outcomes)`` once per batch with every job's outcome, failures included."""
        self._outcome_observers.append(observer)

    @property
    def batches_run(self) -> int:
        """One-step engine runs that returned (:attr:`workers.batch_runner.BatchRunner.batches_run`)."""
        return self._batches.batches_run

    @property
    def generation(self) -> GenerationLoop | None:
        """The stable engine's generation loop, which new sequences join (None: the model cannot generate)."""
        return self._gen.stable

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
                self._gen.replace("canary", generation, loaded=engine is not None)
            else:
                if engine is None:
                    raise ValueError("the stable role always has an engine")
                self._stable = Served(engine, version, "stable", time.time())
                self._gen.replace("stable", generation)
            self._cond.notify_all()

    def _served_for(self, role: Role) -> Served:
        """The engine a job of ``role`` runs on now (caller holds the lock)."""
        if role == "canary" and self._canary is not None:
            return self._canary
        return self._stable

    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The scheduler thread (for the worker's watch of the threads it needs)."""
        return self._thread

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
            if self._stopping or self._gen.stable is None:
                why = "worker is shutting down" if self._stopping else "this model cannot generate"
                seq.future.set_exception(FleetError(why, "worker", None))
            else:
                seq.arrived_s = self.clock()
                self._gen.waiting.append(seq)
            if was_arriving:
                self._arriving -= 1
            self._cond.notify_all()
        return seq.future

    @property
    def generating(self) -> int:
        """Generations waiting to join or running."""
        with self._cond:
            return self._gen.active

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

    def _next_work(self) -> tuple[list[Job], str, Served | None, float, GenWork] | None:
        """The next one-step batch (maybe empty) with the engine it runs on and when it was formed
        (wall clock, s: its ``batch_started_unix_s``), and each generation loop with the sequences
        joining it at the next step (taken under the lock, so a swap never moves joiners to another loop).

        A batch never mixes engines: it takes, of the jobs the policy dispatches, those that run on
        the same engine as the oldest; the others stay pending for the next batch.
        Blocks only while there is nothing to do: a running generation means a step is due now.
        """
        with self._cond:
            while True:
                loops = [loop for loop, _ in self._gen.loops(self._stable, self._canary)]
                self._gen.prune_retiring()
                running = any(loop.has_work() for loop in loops) or bool(self._gen.retiring)
                gen_busy = running or (bool(loops) and bool(self._gen.waiting))
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
                admit = self._gen.waiting and hold_until is None
                gen_work = self._gen.admit(self._stable, self._canary) if admit else [(loop, []) for loop in loops]
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
        if running or not self._gen.waiting or self.start_together_s <= 0:
            return None
        if len(self._gen.waiting) >= self.policy.max_batch_size:
            return None
        until = self._gen.waiting[0].arrived_s + self.start_together_s
        if self.clock() >= until:
            return None
        if on_the_way <= 0 and self._queued_in_redis() <= 0:
            return None
        return until

    def _run(self) -> None:
        """The thread: :meth:`_loop`, and a notice when it ends on an exception (a bug: a batch's or a
        generation step's failure fails those requests and the thread goes on)."""
        try:
            self._loop()
        except BaseException:
            log.critical("the scheduler thread died: no request is computed from now on", exc_info=True)
            for notice in self.on_death:
                try:
                    notice()
                except Exception:
                    log.exception("scheduler death notice failed")

    def _loop(self) -> None:
        while True:
            nxt = self._next_work()
            if nxt is None:
                return
            batch, reason, served, formed_unix_s, gen_work = nxt
            if batch and served is not None:
                try:
                    self._batches.run(batch, reason, served, formed_unix_s)
                except Exception as exc:  # never let one batch kill the thread
                    log.exception("batch failed unexpectedly")
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(exc)
            self._gen.step(gen_work)
            self._gen.report_ended(self._outcome_observers)
