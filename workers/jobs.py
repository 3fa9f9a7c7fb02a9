"""What the scheduler hands around: a one-step :class:`Job` and its :class:`JobResult`, the :class:`Served`
engine a batch captures, and what observers learn (:class:`BatchStats` per batch, :class:`JobOutcome` per job).

Plain data and the observers' types: the scheduler (:mod:`workers.scheduler`) owns the lock that guards a
job's ``handed_over`` and ``cancelled`` flags; :mod:`workers.batch_runner` fills each job's future.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

from protocol.messages import OutputSpec
from workers.engine import Engine

__all__ = ["BatchStats", "Job", "JobOutcome", "JobResult", "Observer", "OutcomeObserver", "Role", "Served",
           "report_outcomes"]

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
    """Cancelled before it was handed over (:meth:`workers.scheduler.Scheduler.cancel`): refused when it is."""


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


def report_outcomes(observers: list[OutcomeObserver], outcomes: list[JobOutcome]) -> None:
    """Hand ``outcomes`` to each observer (one call each); an observer that raises is logged and skipped."""
    for observer in observers:
        try:
            observer(outcomes)
        except Exception:
            log.exception("outcome observer failed")
