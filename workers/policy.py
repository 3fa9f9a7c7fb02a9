"""The batch policy: a pure decision over pending sequences, with the clock passed in.

``BatchPolicy.decide(now_s, pending, arriving)`` answers ``Dispatch(n)`` (take the ``n`` oldest
pending sequences now) or ``Wait(until_s)`` (nothing to do before ``until_s``; ``None`` = until
something arrives). No threads, no I/O, no sleeps: the scheduler owns those.

Rules, in order:

1. nothing pending → wait for an arrival;
2. the oldest sequences fill ``max_batch_size`` or the padded-token budget
   ``max_batch_tokens`` (batch size x longest sequence) → dispatch the largest prefix that fits;
3. ``close_when_idle`` and no request the worker holds is still on its way to the scheduler
   (``arriving == 0``) → dispatch now: waiting cannot gather more company, since with free tokens
   the queue in Redis is drained, and a lone request must not sit out the window
   (Triton's ``max_queue_delay`` defaults to 0 for the same reason);
4. the oldest has waited ``max_wait_ms`` → dispatch everything that fits;
5. otherwise wait until the oldest's window closes.

Arrivals still batch naturally: while the engine computes one batch, the next one gathers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BatchPolicy", "Dispatch", "Pending", "Wait"]


@dataclass(frozen=True)
class Pending:
    """What the policy needs to know of one waiting sequence."""

    arrived_s: float
    """Monotonic time it reached the scheduler (s)."""
    tokens: int
    """Its length (tokens)."""


@dataclass(frozen=True)
class Dispatch:
    """Run the ``count`` oldest pending sequences now."""

    count: int
    reason: str


@dataclass(frozen=True)
class Wait:
    """Decide again at ``until_s`` (monotonic s), or on the next arrival when ``None``."""

    until_s: float | None


class BatchPolicy:
    """Micro-batch formation rules (see the module docstring)."""

    def __init__(
        self, max_batch_size: int, max_wait_ms: float, max_batch_tokens: int, close_when_idle: bool = True
    ) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or max_wait_ms < 0:
            raise ValueError("max_batch_size and max_batch_tokens must be >= 1, max_wait_ms >= 0")
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_batch_tokens = max_batch_tokens
        self.close_when_idle = close_when_idle

    def fitting_prefix(self, pending: Sequence[Pending]) -> int:
        """Largest n such that the n oldest fit both caps (always >= 1 when anything is pending)."""
        longest = 0
        count = 0
        for item in pending[: self.max_batch_size]:
            longest = max(longest, item.tokens)
            if count and (count + 1) * longest > self.max_batch_tokens:
                break
            count += 1
        return count

    def decide(self, now_s: float, pending: Sequence[Pending], arriving: int = 0) -> Dispatch | Wait:
        """Dispatch or wait; ``arriving`` = requests held by the worker not yet handed to the scheduler."""
        if not pending:
            return Wait(None)
        fit = self.fitting_prefix(pending)
        if fit == self.max_batch_size:
            return Dispatch(fit, "full")
        if fit < len(pending):
            return Dispatch(fit, "token_budget")
        if self.close_when_idle and arriving <= 0:
            return Dispatch(fit, "idle")
        deadline = pending[0].arrived_s + self.max_wait_s
        if now_s >= deadline:
            return Dispatch(fit, "window")
        return Wait(deadline)
