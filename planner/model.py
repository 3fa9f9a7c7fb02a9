"""A discrete-event model of the fleet: one Redis queue, worker replicas that micro-batch, an autoscaler.

Per request: it arrives (trace time); admission refuses it (a 429) when ``max_queue_depth`` requests
already wait; otherwise it waits in the queue (FIFO, shared by all replicas) until a ready replica has
a free token (``concurrency`` per replica, as ``worker_prefetch_multiplier=1`` + ``acks_late``); it
reaches that replica after ``fetch_ms``, passes its serial per-request stage (``request_cpu_ms``, one
at a time: the worker's GIL-bound task work), then its scheduler, which forms batches with the worker's own
:class:`workers.policy.BatchPolicy` (``max_batch_size``, ``max_wait_ms``, close-when-idle). One
batch at a time runs per replica for ``service.batch_ms(n) + engine_overhead_ms``; its tokens come
back ``token_return_ms`` later (result publish, ack, next fetch). **Queue wait** = batch start −
arrival, the quantity the worker reports as ``timings.queue_wait_ms``.

Replicas come and go by :class:`planner.scaler.Autoscaler`, asked every ``polling_interval_s``: a
new replica serves after ``start_s``; a removed one takes no new work, finishes what it holds, and
is billed until then. Replica-minutes count every replica from creation to removal (or the end).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from planner.scaler import Autoscaler, ScalerSettings
from planner.service import ServiceTimes
from planner.trace import Trace
from workers.policy import BatchPolicy, Dispatch, Pending

__all__ = ["FleetShape", "Outcome", "simulate"]

_DONE, _TOKENS, _TIMER, _READY, _POLL, _FETCHED = range(6)


@dataclass(frozen=True)
class FleetShape:
    """The worker's settings the model needs (names as in ``configs/fleet.yaml``)."""

    max_batch_size: int = 8
    max_wait_ms: float = 2.0
    concurrency: int = 16
    """Tokens per replica (requests it may hold at once)."""
    max_queue_depth: int = 10_000
    """Admission cap on waiting requests; beyond it a request is refused (429)."""
    fetch_ms: float = 0.0
    """Queue → the worker: broker wake-up latency (ms); counts as queue wait."""
    request_cpu_ms: float = 0.0
    """Per request, serial in the worker process (one GIL): task start, decode, result encode and
    publish, ack (ms). Requests pass it one at a time before reaching the scheduler; on a small
    model it, not the engine, bounds a worker's throughput."""
    engine_overhead_ms: float = 0.0
    """Per batch, on the engine besides ``batch_ms``: padding, postprocess (ms)."""
    token_return_ms: float = 0.0
    """Engine done → the batch's tokens free again: result publish, ack, next fetch (ms)."""
    max_batch_tokens: int = 1 << 30
    """Padded-token budget of a batch (tokens); only binds when the trace has prompt lengths."""
    close_when_idle: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.concurrency < self.max_batch_size:
            raise ValueError(f"need 1 <= max_batch_size <= concurrency, got max_batch_size={self.max_batch_size}, "
                             f"concurrency={self.concurrency}")
        if self.max_queue_depth < 1 or min(self.fetch_ms, self.request_cpu_ms, self.engine_overhead_ms,
                                           self.token_return_ms) < 0:
            raise ValueError("max_queue_depth must be >= 1; fetch_ms, request_cpu_ms, engine_overhead_ms and "
                             "token_return_ms >= 0")


@dataclass(frozen=True)
class Outcome:
    """What one simulated run measured."""

    queue_wait_ms: npt.NDArray[np.float64]
    """Per admitted request, in arrival order of batch start (ms)."""
    refused: int
    """Requests refused at the queue cap (429)."""
    replica_minutes: float
    max_replicas: int
    timeline: list[tuple[float, int, int]]
    """(s, replicas, waiting) at every autoscaler decision."""
    batches: int

    def percentile_ms(self, q: float) -> float:
        """The ``q``-th percentile of queue wait (ms); NaN when nothing was admitted."""
        return float(np.percentile(self.queue_wait_ms, q)) if self.queue_wait_ms.size else float("nan")


@dataclass(eq=False)
class _Replica:
    created_s: float
    ready: bool = False
    draining: bool = False
    gone_s: float | None = None
    free: int = 0
    busy: bool = False
    timer_s: float | None = None
    pending: list[Pending] = field(default_factory=list)
    submitted: list[float] = field(default_factory=list)
    cpu_free_s: float = 0.0
    """When the worker's serial per-request stage is next free (s)."""
    incoming: deque[tuple[float, float, int]] = field(default_factory=deque)
    """Taken from the queue, not yet at the scheduler: (arrives s, submitted s, tokens)."""


class _Run:
    """One simulation; :func:`simulate` is the way in."""

    def __init__(self, trace: Trace, service: ServiceTimes, shape: FleetShape, scaler: ScalerSettings,
                 initial_replicas: int | None) -> None:
        self.trace, self.shape, self.scaler = trace, shape, scaler
        self.batch_ms = service.table(shape.max_batch_size)
        self.fetch_s = shape.fetch_ms / 1000.0
        self.cpu_s = shape.request_cpu_ms / 1000.0
        self.policy = BatchPolicy(shape.max_batch_size, shape.max_wait_ms, shape.max_batch_tokens,
                                  shape.close_when_idle)
        self.autoscaler = Autoscaler(scaler)
        self.events: list[tuple[float, int, int, _Replica | None, int]] = []
        self.seq = itertools.count()
        self.queue: deque[tuple[float, int]] = deque()
        self.replicas: list[_Replica] = []
        self.taking: list[_Replica] = []
        """Ready replicas that take new work (not draining)."""
        self.waits: list[float] = []
        self.refused = 0
        self.batches = 0
        self.timeline: list[tuple[float, int, int]] = []
        start = scaler.min_replicas if initial_replicas is None else initial_replicas
        for _ in range(start):
            self._ready(self._add(0.0, ready=True), 0.0)

    def _push(self, at_s: float, kind: int, replica: _Replica | None = None, n: int = 0) -> None:
        heapq.heappush(self.events, (at_s, next(self.seq), kind, replica, n))

    def _add(self, now_s: float, *, ready: bool = False) -> _Replica:
        r = _Replica(created_s=now_s)
        self.replicas.append(r)
        if not ready:
            self._push(now_s + self.scaler.start_s, _READY, r)
        return r

    def _ready(self, r: _Replica, now_s: float) -> None:
        if r.gone_s is None and not r.draining:
            r.ready, r.free = True, self.shape.concurrency
            self.taking.append(r)
            self._feed(now_s)

    def _serving(self) -> list[_Replica]:
        return [r for r in self.replicas if r.gone_s is None and not r.draining]

    def _feed(self, now_s: float) -> None:
        """Hand waiting requests to ready replicas with free tokens, the one with most free first."""
        queue = self.queue
        if not queue:
            return
        touched: list[_Replica] = []
        while queue:
            best, most = None, 0
            for r in self.taking:
                if r.free > most:
                    best, most = r, r.free
            if best is None:
                break
            submitted_s, tokens = queue.popleft()
            best.free -= 1
            if self.cpu_s:
                best.cpu_free_s = max(now_s + self.fetch_s, best.cpu_free_s) + self.cpu_s
                best.incoming.append((best.cpu_free_s, submitted_s, tokens))
                self._push(best.cpu_free_s, _FETCHED, best)
                continue
            if self.fetch_s:
                best.incoming.append((now_s + self.fetch_s, submitted_s, tokens))
            else:
                best.pending.append(Pending(now_s, tokens))
                best.submitted.append(submitted_s)
            if best not in touched:
                touched.append(best)
        for r in touched:
            if self.fetch_s:
                self._push(now_s + self.fetch_s, _FETCHED, r)
            else:
                self._dispatch(r, now_s)

    def _fetched(self, r: _Replica, now_s: float) -> None:
        while r.incoming and r.incoming[0][0] <= now_s:
            _, submitted_s, tokens = r.incoming.popleft()
            r.pending.append(Pending(now_s, tokens))
            r.submitted.append(submitted_s)
        self._dispatch(r, now_s)

    def _dispatch(self, r: _Replica, now_s: float) -> None:
        if r.busy or not r.pending:
            return
        decision = self.policy.decide(now_s, r.pending, len(r.incoming))
        if isinstance(decision, Dispatch):
            n = decision.count
            self.waits.extend(now_s - s for s in r.submitted[:n])
            del r.pending[:n], r.submitted[:n]
            r.busy, r.timer_s = True, None
            self.batches += 1
            self._push(now_s + (self.batch_ms[n] + self.shape.engine_overhead_ms) / 1000.0, _DONE, r, n)
        elif decision.until_s is not None and r.timer_s != decision.until_s:
            r.timer_s = decision.until_s
            self._push(decision.until_s, _TIMER, r)

    def _tokens_back(self, r: _Replica, n: int, now_s: float) -> None:
        r.free += n
        if r.draining and r.free >= self.shape.concurrency:
            r.gone_s = now_s
        self._feed(now_s)

    def _poll(self, now_s: float) -> None:
        serving = self._serving()
        waiting = len(self.queue)
        held = sum(self.shape.concurrency - r.free for r in serving if r.ready)
        want = self.autoscaler.decide(now_s, len(serving), waiting, held)
        for _ in range(want - len(serving)):
            self._add(now_s)
        if want < len(serving):
            # Starting pods go first, then the least busy.
            for r in sorted(serving, key=lambda x: (x.ready, self.shape.concurrency - x.free))[: len(serving) - want]:
                r.draining = True
                if r in self.taking:
                    self.taking.remove(r)
                if not r.ready or r.free >= self.shape.concurrency:
                    r.gone_s = now_s
        self.timeline.append((now_s, len(self._serving()), waiting))

    def _arrive(self, at_s: float, tokens: int) -> None:
        if len(self.queue) >= self.shape.max_queue_depth:
            self.refused += 1
            return
        self.queue.append((at_s, tokens))
        self._feed(at_s)

    def _handle(self, at_s: float, kind: int, r: _Replica | None, n: int) -> None:
        if kind == _POLL:
            self._poll(at_s)
            if at_s + self.scaler.polling_interval_s <= self.trace.duration_s:
                self._push(at_s + self.scaler.polling_interval_s, _POLL)
            return
        assert r is not None
        if kind == _DONE:
            r.busy = False
            if self.shape.token_return_ms > 0:
                self._push(at_s + self.shape.token_return_ms / 1000.0, _TOKENS, r, n)
            else:
                self._tokens_back(r, n, at_s)
            self._dispatch(r, at_s)
        elif kind == _TOKENS:
            self._tokens_back(r, n, at_s)
        elif kind == _FETCHED:
            self._fetched(r, at_s)
        elif kind == _TIMER:
            if r.timer_s == at_s:
                r.timer_s = None
                self._dispatch(r, at_s)
        else:
            self._ready(r, at_s)

    def run(self) -> Outcome:
        arrivals = self.trace.arrival_s.tolist()
        tokens = self.trace.prompt_tokens.tolist() if self.trace.prompt_tokens is not None else [1] * len(arrivals)
        self._push(0.0, _POLL)
        i, end_s = 0, 0.0
        while i < len(arrivals) or self.events:
            if i < len(arrivals) and (not self.events or arrivals[i] <= self.events[0][0]):
                end_s = arrivals[i]
                self._arrive(arrivals[i], tokens[i])
                i += 1
                continue
            at_s, _, kind, r, n = heapq.heappop(self.events)
            end_s = at_s
            self._handle(at_s, kind, r, n)
            if not self.events and i >= len(arrivals) and self.queue:
                break  # nobody left to serve what waits (scaled to zero with activation off)
        end_s = max(end_s, self.trace.duration_s)
        minutes = sum(((r.gone_s if r.gone_s is not None else end_s) - r.created_s) for r in self.replicas) / 60.0
        most = max((c for _, c, _ in self.timeline), default=0)
        return Outcome(np.asarray(self.waits) * 1000.0, self.refused, minutes, most, self.timeline, self.batches)


def simulate(trace: Trace, service: ServiceTimes, shape: FleetShape, scaler: ScalerSettings, *,
             initial_replicas: int | None = None) -> Outcome:
    """Replay ``trace`` through the model; ``initial_replicas`` ready at 0 s (default ``min_replicas``).

    For a fixed fleet of N workers use ``ScalerSettings(min_replicas=N, max_replicas=N)``.
    """
    return _Run(trace, service, shape, scaler, initial_replicas).run()
