"""What a worker's runtime counts for its scheduler and its readiness (:class:`RuntimeCounts`).

* engine steps run so far (batches, and the steps of every generation loop: the stable one, the canary's
  and those retiring after a swap; progress, :mod:`workers.progress`);
* the requests Celery holds for this worker, less those waiting on another delivery of their generation;
* the requests on their way to the scheduler (taken from Redis, not yet in its hands);
* the messages waiting in Redis on the lists this worker takes from (one round trip; the start-together
  wait's read gives up after :data:`HOLD_DEPTH_TIMEOUT_S` s).

:class:`workers.worker_runtime.WorkerRuntime` inherits these and hands them to the scheduler and the
progress watch as callbacks.
"""

from __future__ import annotations

from celery.worker import state as worker_state
from redis import Redis

from broker import TAKEN_IN_HAND, queue_depth
from workers.direct_queue import DirectQueue
from workers.generation.loop import GenStepStats
from workers.progress import Held, copied, held_requests
from workers.run_claims import RunClaims
from workers.scheduler import Scheduler

__all__ = ["HOLD_DEPTH_TIMEOUT_S", "RuntimeCounts"]

HOLD_DEPTH_TIMEOUT_S = 0.25
"""Connect and read timeout (s) of the queue-depth read behind the start-together wait, tried once: it
runs while the scheduler's lock is held, so a slow or unreachable Redis ends the wait (the burst
starts) instead of stalling arrivals."""


class RuntimeCounts:
    """The counts of a worker's runtime; reads only the attributes declared here (set by the runtime)."""

    redis: Redis[bytes]
    queue: str
    canary_queue: str
    direct_queue: DirectQueue
    scheduler: Scheduler
    run_claims: RunClaims
    _depth_redis: Redis[bytes]
    _generation_steps: int
    """Generation steps run so far on any loop (:meth:`_count_generation_step`)."""

    def _work_done(self) -> int:
        """Engine steps run so far: batches and the generation steps of every loop (progress, for readiness).

        Not the stable loop's ``steps_run``: a canary's generations, and those finishing on a loop retired by a
        swap, step other loops, and a worker serving only those read as making no progress (not ready)."""
        return self.scheduler.batches_run + self._generation_steps

    def _count_generation_step(self, _stats: GenStepStats) -> None:
        """A generation loop observer (on the scheduler thread, which alone steps loops): one step ran. Added
        to the stable loop; :meth:`~workers.worker_runtime.WorkerRuntime.swap` hands a loop's observers on to
        the loop that replaces it and to a canary's, so every loop the worker steps counts."""
        self._generation_steps += 1

    def _held_for_progress(self) -> list[Held]:
        """The requests Celery holds for this worker, less the deliveries waiting for another delivery of
        their generation to end (:mod:`workers.run_claims`): that work is progressed elsewhere."""
        waiting = self.run_claims.waiting
        held = held_requests()
        return [h for h in held if h.task_id not in waiting] if waiting else held

    def _on_their_way(self) -> int:
        """Requests this worker process took from Redis whose threads have not reached its code yet: in
        the channel's hand (a take in flight, taken, being handed over) or held by Celery, not started.
        Counted once each, none missed between the two (:meth:`broker.in_hand.InHand.beside`)."""
        task_ids, anonymous = TAKEN_IN_HAND.beside(_held_task_ids)
        return self.scheduler.unseen(task_ids) + anonymous

    def _own_queues(self) -> list[str]:
        """The queues this worker takes from: the model's queue, its canary queue and its own queue (if consumed)."""
        return [self.queue, self.canary_queue] + ([self.direct_queue.name] if self.direct_queue.consumed else [])

    def _waiting_in_redis(self) -> int:
        """Messages waiting on the lists this worker takes from (priority siblings included), for the
        scheduler's start-together wait; one round trip, at most ``HOLD_DEPTH_TIMEOUT_S``."""
        return queue_depth(self._depth_redis, *self._own_queues())

    def _queued(self) -> int:
        """Messages waiting in this worker's queue, canary queue and own queue, kombu's priority lists
        included (a message a plain Celery client sent with ``priority=`` waits in one of those)."""
        return queue_depth(self.redis, *self._own_queues())


def _held_task_ids() -> set[str]:
    """The Celery task IDs this worker has received and not finished (reserved, active ones included), read
    from the scheduler's thread while the consumer's changes the set (:func:`workers.progress.copied`)."""
    return {str(r.id) for r in copied(worker_state.reserved_requests)}
