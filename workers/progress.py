"""Is this worker progressing the work it holds? Readiness that sees a wedged worker, and overdue slots.

A worker's heartbeat used to say ready as long as its process ran, so a worker whose C slots
were all taken by messages it would never finish (never acked, never freed) looked healthy while
valid requests waited forever. :class:`ProgressWatch` (pure: the time and what the worker holds
go in, a :class:`ProgressReport` comes out) decides from what the heartbeat already samples:

* **progress** is a held request finishing (its ID leaves the held set), a new one taken, or the
  engine running a batch or a generation step;
* a worker is **stalled** when it holds requests, or its queue is non-empty, and made no progress
  for ``worker.stall_after_s``; a stalled worker's heartbeat says ``ready: false`` (and so does
  ``fleet probe ready``) until it progresses again;
* a **slot is overdue** when its request is held past its deadline (``deadline_unix_s``; without
  one, past the visibility timeout, when Redis hands the message to another worker) by more than
  ``worker.slot_grace_s``: reported once per request (log line, ``fleet_worker_overdue_slots``).

Progress is not success: a worker whose engine fails every run finishes (fails) each request it takes at
once and never stalls. :class:`FailureStreak` (pure) counts the engine's failed runs in a row (a one-step
batch, or the generations one scheduler step ended, none of whose requests succeeded); from
``worker.not_ready_after_failed_runs`` of them the worker is not ready until a run succeeds. Requests refused
before the engine (invalid input, deadline passed, cancelled) never reach it: they do not count.
:class:`ThreadWatch` names the worker's long-lived threads that ended (an exception they did not catch):
not ready at once, for good. :func:`not_ready_reason` (pure) says why a worker is not ready, in words:
the heartbeat's ``not_ready``, which ``fleet probe ready`` prints.

:class:`WorkerProgress` is the I/O side: it reads the requests Celery holds for this worker
(``celery.worker.state.reserved_requests``: received, not yet finished), the engine's step counts
and, only when nothing is held, the queue's length; it observes the engine's outcomes for the streak.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from celery.worker import state as worker_state
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protocol.settings_worker import WorkerSettings

if TYPE_CHECKING:
    from workers.jobs import JobOutcome

__all__ = ["FailureStreak", "Held", "ProgressCollector", "ProgressReport", "ProgressWatch", "ThreadWatch",
           "WorkerProgress", "copied", "deadline_of", "not_ready_reason"]

T = TypeVar("T")

_DEFAULT_FAILED_RUNS: int = WorkerSettings.model_fields["not_ready_after_failed_runs"].default

log = logging.getLogger("fleet.progress")


@dataclass(frozen=True)
class Held:
    """One request the worker holds: its task ID and deadline (wall-clock Unix s; None = none)."""

    task_id: str
    deadline_unix_s: float | None


@dataclass(frozen=True)
class ProgressReport:
    """What one observation found."""

    held: int
    """Requests held (slots of C taken)."""
    queued: int
    """Items in the worker's queues (read only when nothing is held; 0 otherwise)."""
    stalled_for_s: float
    """Seconds without progress while holding work (0 when idle or progressing)."""
    stalled: bool
    """``stalled_for_s`` reached ``stall_after_s``: the worker is not ready."""
    overdue: int
    """Held requests past their deadline + grace."""
    newly_overdue: tuple[Held, ...] = ()
    """Those found overdue by this observation (each is reported once)."""


@dataclass
class ProgressWatch:
    """Pure progress bookkeeping (see the module doc); times are passed in, never read."""

    stall_after_s: float
    slot_grace_s: float
    no_deadline_s: float
    """How long a request without a deadline may be held before its grace starts (s)."""
    _first_seen: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> (monotonic s, unix s)
    _reported: set[str] = field(default_factory=set)
    _work_done: int | None = None
    _last_progress_s: float | None = None

    def observe(self, now_s: float, now_unix_s: float, held: Iterable[Held], work_done: int,
                queued: int = 0) -> ProgressReport:
        """One sample: ``now_s`` monotonic seconds, ``held`` the requests held now, ``work_done`` a
        counter of engine steps (batches + generation steps), ``queued`` the queue's length."""
        held_now = {h.task_id: h for h in held}
        left = self._first_seen.keys() - held_now.keys()
        taken = held_now.keys() - self._first_seen.keys()
        progressed = bool(left or taken) or (self._work_done is not None and work_done != self._work_done)
        for task_id in left:
            del self._first_seen[task_id]
            self._reported.discard(task_id)
        for task_id in taken:
            self._first_seen[task_id] = (now_s, now_unix_s)
        self._work_done = work_done
        busy = bool(held_now) or queued > 0
        if progressed or not busy or self._last_progress_s is None:
            self._last_progress_s = now_s
        stalled_for_s = now_s - self._last_progress_s
        overdue = [h for h in held_now.values() if self._overdue(h, now_s, now_unix_s)]
        newly = tuple(h for h in overdue if h.task_id not in self._reported)
        self._reported.update(h.task_id for h in newly)
        return ProgressReport(
            held=len(held_now), queued=queued, stalled_for_s=stalled_for_s,
            stalled=stalled_for_s >= self.stall_after_s, overdue=len(overdue), newly_overdue=newly,
        )

    def held_for_s(self, task_id: str, now_s: float) -> float:
        """Seconds since ``task_id`` was first seen held (0 if it is not)."""
        seen = self._first_seen.get(task_id)
        return 0.0 if seen is None else now_s - seen[0]

    def _overdue(self, held: Held, now_s: float, now_unix_s: float) -> bool:
        if held.deadline_unix_s is not None:
            return now_unix_s > held.deadline_unix_s + self.slot_grace_s
        return self.held_for_s(held.task_id, now_s) > self.no_deadline_s + self.slot_grace_s


@dataclass
class FailureStreak:
    """The engine's failed runs in a row (pure; see the module doc).

    Fed one report per run: the outcomes of a one-step batch (its one-by-one retries included), or of the
    generations one scheduler step ended (:meth:`workers.scheduler.Scheduler.add_outcome_observer`). A
    report with a success ends the streak; one without any is a failed run."""

    limit: int
    """Failed runs in a row from which the worker is not ready (``worker.not_ready_after_failed_runs``)."""
    failed_in_a_row: int = 0

    @property
    def failing(self) -> bool:
        """The last ``limit`` runs (at least) failed, and none succeeded since."""
        return self.failed_in_a_row >= self.limit

    def observe(self, outcomes: Sequence[JobOutcome]) -> bool:
        """Count one run's ``outcomes``; True when :attr:`failing` changed (an empty report changes nothing)."""
        if not outcomes:
            return False
        was = self.failing
        self.failed_in_a_row = 0 if any(o.ok for o in outcomes) else self.failed_in_a_row + 1
        return self.failing != was


class ThreadWatch:
    """The long-lived threads a worker cannot serve without; :meth:`dead` names those that ended.

    A thread counts once started (one not started yet is not dead), or once it announced its end
    (:meth:`ended`, from the dying thread itself, which is still alive then); each death is logged once. Once
    :meth:`closing` is called (the worker stops them), an ended thread is no death."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._ended: set[str] = set()
        self._reported: set[str] = set()

    def watch(self, *threads: threading.Thread) -> None:
        """Watch ``threads`` from now on."""
        self._threads.extend(threads)

    def ended(self, thread: threading.Thread) -> None:
        """``thread`` announces its end (on itself, as it ends): dead from now on, before it finishes."""
        self._ended.add(thread.name)

    def closing(self) -> None:
        """The worker stops its threads now: their ends are not deaths."""
        self._closing = True

    def dead(self) -> list[str]:
        """The names of the watched threads that ended, in the order watched ([] once closing)."""
        if self._closing:
            return []
        dead = [t.name for t in self._threads
                if t.name in self._ended or (t.ident is not None and not t.is_alive())]
        for name in dead:
            if name not in self._reported:
                self._reported.add(name)
                log.critical("thread %s ended while the worker runs (an exception it did not catch, logged before): "
                             "reporting not ready until the worker restarts", name)  # fmt: skip
        return dead


def not_ready_reason(*, consuming: bool, shutting_down: bool, dead_threads: Sequence[str], failures: FailureStreak,
                     report: ProgressReport, stall_after_s: float) -> str | None:
    """Why a worker is not ready, in words (the first reason that applies), or None when it is ready.

    In order: a shutdown began; the consumer does not run (loading, warming up, or stopped); a watched thread
    died (:class:`ThreadWatch`); the engine failed ``failures.limit`` runs in a row; the worker holds work it
    did not progress for ``stall_after_s`` (s) (:class:`ProgressWatch`)."""
    if shutting_down:
        return "shutting down (draining what it holds; it takes nothing new)"
    if not consuming:
        return "its consumer does not run (loading, warming up, or stopped)"
    if dead_threads:
        return (f"thread {', '.join(dead_threads)} died (an exception it did not catch, in the worker's log): what it "
                "did is no longer done; restart the worker")
    if failures.failing:
        return (f"its engine failed {failures.failed_in_a_row} runs in a row, none succeeded "
                f"(worker.not_ready_after_failed_runs={failures.limit}): it fails the requests it takes")
    if report.stalled:
        holds = f"holds {report.held} requests" if report.held else "has a non-empty queue"
        return (f"it {holds} and made no progress for {report.stalled_for_s:.0f} s "
                f"(worker.stall_after_s={stall_after_s:g}): it is not progressing the work it holds")
    return None


def deadline_of(args: Any) -> float | None:
    """The deadline of a ``fleet.infer`` or ``fleet.infer_bulk`` message's ``args`` (a bulk message's
    latest; None when a request has none or the args are not a request)."""
    payload = args[0] if isinstance(args, list | tuple) and len(args) == 1 else None
    if not isinstance(payload, dict):
        return None
    requests = payload.get("requests") if "requests" in payload else [payload]
    deadlines: list[float] = []
    for request in requests if isinstance(requests, list) and requests else [None]:
        deadline = request.get("deadline_unix_s") if isinstance(request, dict) else None
        if not isinstance(deadline, int | float) or isinstance(deadline, bool):
            return None
        deadlines.append(float(deadline))
    return max(deadlines)


def copied(items: Iterable[T], tries: int = 5) -> list[T]:
    """``items`` as a list, read from another thread: Celery's sets of requests (``WeakSet``) change on the
    consumer's thread, and a copy that meets a change raises RuntimeError ("Set changed size during
    iteration"); it is tried again, up to ``tries`` times, then [] (what it is used for reads it again
    soon)."""
    for _ in range(tries):
        try:
            return list(items)
        except RuntimeError:
            continue
    return []


def held_requests() -> list[Held]:
    """The requests Celery holds for this worker (received, not finished), read from another thread.

    A request with an ETA that has not started is left out: it waits by design, in Celery's timer, for at
    most half the visibility timeout (the poison guard refuses an ETA further ahead:
    :func:`broker.max_eta_ahead_s`), so it is due, and runs, with half the timeout left before kombu could
    hand its message to another worker.
    """
    requests = copied(worker_state.reserved_requests)
    running = {id(r) for r in copied(worker_state.active_requests)}
    return [Held(str(r.id), deadline_of(getattr(r, "args", None))) for r in requests
            if id(r) in running or not getattr(r, "eta", None)]


class WorkerProgress:
    """The watch wired to this worker: Celery's held requests, the engine's step count, the queue length, and
    the engine's outcomes (:meth:`engine_outcomes`, a scheduler outcome observer)."""

    def __init__(self, watch: ProgressWatch, work_done: Callable[[], int], queued: Callable[[], int],
                 held: Callable[[], list[Held]] = held_requests,
                 clock: Callable[[], float] = time.monotonic, failures: FailureStreak | None = None) -> None:
        self.watch = watch
        self.failures = failures if failures is not None else FailureStreak(limit=_DEFAULT_FAILED_RUNS)
        """The engine's failed runs in a row (``worker.not_ready_after_failed_runs``: its default when not given)."""
        self.on_failing: list[Callable[[], None]] = []
        """Called (scheduler thread) when :attr:`FailureStreak.failing` changes: readiness changed."""
        self._work_done = work_done
        self._queued = queued
        self._held = held
        self._clock = clock
        self._lock = threading.Lock()
        self.overdue_total = 0
        """Requests reported overdue since the worker started."""
        self.last = ProgressReport(held=0, queued=0, stalled_for_s=0.0, stalled=False, overdue=0)

    def check(self) -> ProgressReport:
        """Observe now (the heartbeat calls this each period); logs stalls and overdue slots."""
        with self._lock:
            held = self._held()
            queued = 0
            if not held:
                try:
                    queued = self._queued()
                except Exception as exc:  # Redis away: the heartbeat itself will say so
                    log.debug("queue length unavailable: %s", exc)
            now_s = self._clock()
            report = self.watch.observe(now_s, time.time(), held, self._work_done(), queued)
            for h in report.newly_overdue:
                self.overdue_total += 1
                limit_s = self.watch.no_deadline_s
                why = f" (none: visibility timeout {limit_s:.0f} s)" if h.deadline_unix_s is None else ""
                log.warning("request %s has held a slot for %.0f s, past its deadline%s + slot_grace_s=%.0f s: it is "
                            "not progressing", h.task_id, self.watch.held_for_s(h.task_id, now_s), why,
                            self.watch.slot_grace_s)
            if report.stalled and not self.last.stalled:
                log.error("worker holds %d requests (queue %d) and made no progress for %.0f s "
                          "(worker.stall_after_s=%.0f): reporting not ready", report.held, report.queued,
                          report.stalled_for_s, self.watch.stall_after_s)
            elif self.last.stalled and not report.stalled:
                log.warning("worker progresses again: reporting ready")
            self.last = report
            return report

    def engine_outcomes(self, outcomes: list[JobOutcome]) -> None:
        """An outcome observer of the scheduler (its thread): one engine run's outcomes (:class:`FailureStreak`)."""
        if not self.failures.observe(outcomes):
            return
        if self.failures.failing:
            log.error("the engine failed %d runs in a row, none succeeded (worker.not_ready_after_failed_runs=%d): "
                      "reporting not ready until a run succeeds", self.failures.failed_in_a_row,
                      self.failures.limit)  # fmt: skip
        else:
            log.warning("an engine run succeeded again: reporting ready")
        for hook in self.on_failing:
            hook()


class ProgressCollector(Collector):
    """Prometheus series of :class:`WorkerProgress` (as of the last heartbeat) and of
    :func:`workers.trace_guard.outside_body_errors`."""

    def __init__(self, model: str, progress: WorkerProgress, outside_body_errors: Callable[[], int]) -> None:
        self.model = model
        self.progress = progress
        self.outside_body_errors = outside_body_errors

    def collect(self) -> Iterable[Any]:
        last = self.progress.last
        series: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, float]] = [
            (GaugeMetricFamily, "fleet_worker_held_slots", "Requests held (slots of C taken), any stage.", last.held),
            (GaugeMetricFamily, "fleet_worker_stalled", "1 while the worker holds work it does not progress.",
             1.0 if last.stalled else 0.0),
            (GaugeMetricFamily, "fleet_worker_stalled_seconds", "Seconds without progress while holding work.",
             last.stalled_for_s),
            (GaugeMetricFamily, "fleet_worker_overdue_slots", "Held requests past their deadline + slot_grace_s.",
             last.overdue),
            (CounterMetricFamily, "fleet_worker_overdue_slots_reported", "Requests reported overdue.",
             self.progress.overdue_total),
            (CounterMetricFamily, "fleet_worker_outside_body_errors",
             "Exceptions raised by Celery's handling around a task body (message acked as failed).",
             self.outside_body_errors()),
        ]
        for family, name, doc, value in series:
            metric = family(name, doc, labels=["model"])
            metric.add_metric([self.model], float(value))
            yield metric
