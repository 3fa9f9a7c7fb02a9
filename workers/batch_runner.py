"""One engine step for a formed batch of one-step jobs (next-token top-k, embeddings).

The scheduler thread (:mod:`workers.scheduler`) forms the batch and captures the engine it runs on;
:meth:`BatchRunner.run` drops the jobs whose deadline has passed, pads the rest, runs the engine once,
slices each job's result back out into its future, and tells the observers: :class:`BatchStats` per engine
run, :class:`JobOutcome` per job. A failed batch is retried one job at a time, so one request never fails
its neighbours.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from protocol.errors import RequestExpired
from workers.engine import Engine
from workers.jobs import BatchStats, Job, JobOutcome, JobResult, Observer, OutcomeObserver, Served, report_outcomes
from workers.padding import PaddedBatch, pad_batch
from workers.postprocess import last_positions, pool, top_k_logprobs

__all__ = ["BatchRunner"]

log = logging.getLogger("fleet.scheduler")

_Output = tuple[list[int] | None, list[float] | None, list[float] | None]


class BatchRunner:
    """Runs the scheduler's one-step batches (from its thread) and tells its observers about each."""

    def __init__(
        self, clock: Callable[[], float], observers: list[Observer], outcome_observers: list[OutcomeObserver]
    ) -> None:
        """``clock``: the scheduler's monotonic clock (s), for deadlines, batch waits and inference times.
        ``observers`` and ``outcome_observers`` are the scheduler's own lists (shared, not copied: an
        observer added later is called too)."""
        self.clock = clock
        self._observers = observers
        self._outcome_observers = outcome_observers
        self.batches_run = 0
        """Engine runs that returned (a failed batch's retries, one job each, count one each)."""

    def run(self, batch: list[Job], reason: str, served: Served, formed_unix_s: float) -> None:
        """Compute ``batch`` on ``served``'s engine and resolve every job's future.

        ``reason`` is the policy's, for :class:`BatchStats`; ``formed_unix_s`` when the batch formed (wall
        clock, s: each result's ``batch_started_unix_s``). A job past its ``deadline_s`` (clock s) fails with
        :class:`~protocol.errors.RequestExpired` and is not run; an engine failure fails the futures.
        """
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

    def _report_outcomes(self, jobs: list[Job], served: Served) -> None:
        if not self._outcome_observers:
            return
        outcomes = [
            JobOutcome(served.version, served.role, job.future.exception() is None, job.submitted_unix_s, job.role)
            for job in jobs
        ]
        report_outcomes(self._outcome_observers, outcomes)

    @staticmethod
    def _outputs(engine: Engine, jobs: list[Job], out: npt.NDArray[np.float32], padded: PaddedBatch) -> list[_Output]:
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
