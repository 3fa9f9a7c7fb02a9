"""Per-request outcomes for the canary guard and ``fleet models compare``.

A scheduler outcome observer: after every batch it writes one entry per request (version, role,
ok, enqueue→result latency in ms, the role its queue asked for) to the model's outcomes stream, all
in ONE Redis pipeline per batch, and only while the model's state has a canary (otherwise it returns
at once: zero Redis cost).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from protocol.canary_verdict import Outcome
from protocol.model_state import record_outcomes
from workers.scheduler import JobOutcome

__all__ = ["OutcomeWriter"]

log = logging.getLogger("fleet.outcomes")


class OutcomeWriter:
    """Writes a batch's outcomes to ``fleet:model-outcomes:<model>`` while ``active()`` is true."""

    def __init__(self, client: redis.Redis[bytes], model: str, active: Callable[[], bool]) -> None:
        self.client = client
        self.model = model
        self.active = active

    def __call__(self, outcomes: list[JobOutcome]) -> None:
        """Scheduler outcome observer (runs on the scheduler thread; one round trip per batch)."""
        if not outcomes or not self.active():
            return
        now = time.time()
        samples = [
            Outcome(o.version, o.role, o.ok, max(0.0, (now - o.submitted_unix_s) * 1000) if o.submitted_unix_s else 0.0,
                    now, o.asked)
            for o in outcomes
        ]
        try:
            with self.client.pipeline(transaction=False) as pipe:
                record_outcomes(pipe, self.model, samples)
                pipe.execute()
        except redis.RedisError as exc:  # outcomes never fail a request
            log.warning("could not record %d outcomes: %s", len(samples), exc)
