"""Pure statistics of a load run: percentiles, latency summaries, batch figures, Poisson arrivals.

No I/O and no clocks: every time is passed in (seconds from ``time.perf_counter``), so each
function is tested with plain tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from protocol.messages import InferenceResult

__all__ = [
    "LatencySummary",
    "RequestRecord",
    "RunSummary",
    "batch_figures",
    "percentile",
    "poisson_arrivals",
    "summarize_latencies",
    "summarize_run",
    "summarize_runs",
]


@dataclass(frozen=True)
class RequestRecord:
    """One request as the load generator saw it (times in seconds, ``time.perf_counter``)."""

    submit_s: float
    """When the client started submitting."""
    done_s: float
    """When the client had the result (or the error)."""
    input_tokens: int
    batch_size: int = 0
    """Sequences in the batch it ran in (0 when unknown or failed)."""
    padded_tokens: int = 0
    """batch_size x padded length of that batch (tokens)."""
    inference_ms: float = 0.0
    """Engine time of that batch (ms)."""
    queue_wait_ms: float = 0.0
    """Producer submit → start of the batch it ran in (ms, the worker's figure)."""
    error: str | None = None

    @classmethod
    def from_result(cls, submit_s: float, done_s: float, result: InferenceResult) -> RequestRecord:
        """A successful request, with the worker's own timings."""
        t = result.timings
        return cls(submit_s, done_s, result.input_tokens, t.batch_size, t.padded_tokens, t.inference_ms,
                   t.queue_wait_ms)  # fmt: skip

    @property
    def latency_ms(self) -> float:
        """Submit → result available (ms)."""
        return 1000.0 * (self.done_s - self.submit_s)


@dataclass(frozen=True)
class LatencySummary:
    """Latency distribution of a set of requests (ms)."""

    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


@dataclass(frozen=True)
class RunSummary:
    """What one load run measured."""

    requests: int
    """Successful requests counted (inside the measuring window)."""
    errors: int
    qps: float
    """Completed requests per second of the window."""
    latency: LatencySummary
    mean_batch_size: float
    """Requests per batch (batches seen through their requests)."""
    padding_efficiency: float
    """Real tokens / padded tokens computed, in [0, 1]."""
    window_s: float
    qps_counted: float = float("nan")
    """Completed requests / window time, when ``qps`` comes from Little's law (closed loops)."""
    queue_wait_p50_ms: float = float("nan")
    """Median producer submit → batch start, as the worker measured it (ms)."""
    engine_p50_ms: float = float("nan")
    """Median engine time of the batch each request ran in (ms)."""

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly view (nested latency included)."""
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics.

    Matches ``numpy.percentile(values, q)`` (method 'linear').

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q} outside [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize_latencies(latencies_ms: Sequence[float]) -> LatencySummary:
    """Mean, p50, p95, p99 and max of ``latencies_ms``; all NaN (count 0) when empty."""
    if not latencies_ms:
        nan = float("nan")
        return LatencySummary(0, nan, nan, nan, nan, nan)
    return LatencySummary(
        count=len(latencies_ms),
        mean_ms=float(sum(latencies_ms) / len(latencies_ms)),
        p50_ms=percentile(latencies_ms, 50),
        p95_ms=percentile(latencies_ms, 95),
        p99_ms=percentile(latencies_ms, 99),
        max_ms=float(max(latencies_ms)),
    )


def batch_figures(records: Sequence[RequestRecord]) -> tuple[float, float]:
    """(mean batch size, padding efficiency) from the requests' view of their batches.

    Each request of a batch of ``b`` reports ``b`` and the batch's padded tokens, so the number of
    batches is ``sum(1/b)`` and the batch's padded tokens are counted ``b`` times: dividing each by
    ``b`` gives exact totals when every request of every batch is in ``records``. NaN when no
    record knows its batch.
    """
    known = [r for r in records if r.batch_size > 0 and r.error is None]
    if not known:
        return float("nan"), float("nan")
    batches = sum(1.0 / r.batch_size for r in known)
    padded = sum(r.padded_tokens / r.batch_size for r in known)
    real = sum(r.input_tokens for r in known)
    return len(known) / batches, (real / padded if padded > 0 else float("nan"))


def summarize_run(records: Sequence[RequestRecord], window: tuple[float, float] | None = None) -> RunSummary:
    """Summarize a run.

    Args:
        records: every request of the run.
        window: ``(start_s, end_s)``: count only requests that completed inside it (steady state of
            a closed loop: warm-up and drain excluded); None = from the first submit to the last
            completion (an open loop or a fixed number of requests).
    """
    return summarize_runs([(records, window)])


def summarize_runs(
    runs: Sequence[tuple[Sequence[RequestRecord], tuple[float, float] | None]], *, clients: int | None = None
) -> RunSummary:
    """Pool several runs of one configuration (e.g. interleaved rounds) into one summary.

    Each run is ``(records, window)`` as for :func:`summarize_run`; the latency percentiles are over
    every counted request. QPS is the counted requests over the summed windows, or, for a closed
    loop of ``clients`` always-busy clients, Little's law: ``clients / mean latency``. The count
    is quantized when a batch of 8 completes at once inside a few-second window (±1 batch per
    window edge); Little's law uses every request's latency instead. Both are kept
    (``qps_counted``).
    """
    counted: list[RequestRecord] = []
    errors = 0
    span = 0.0
    for records, window in runs:
        ok = [r for r in records if r.error is None]
        errors += len(records) - len(ok)
        if window is None:
            start = min((r.submit_s for r in records), default=0.0)
            end = max((r.done_s for r in records), default=0.0)
            counted += ok
        else:
            start, end = window
            counted += [r for r in ok if start <= r.done_s <= end]
        span += max(end - start, 0.0)
    span = max(span, 1e-9)
    mean_batch, padding = batch_figures(counted)
    latency = summarize_latencies([r.latency_ms for r in counted])
    timed = [r for r in counted if r.batch_size > 0]  # records that carry the worker's timings
    counted_qps = len(counted) / span if counted else 0.0
    little = clients is not None and counted and latency.mean_ms > 0
    return RunSummary(
        requests=len(counted),
        errors=errors,
        qps=1000.0 * clients / latency.mean_ms if little and clients else counted_qps,
        latency=latency,
        mean_batch_size=mean_batch,
        padding_efficiency=padding,
        window_s=span,
        qps_counted=counted_qps if little else float("nan"),
        queue_wait_p50_ms=percentile([r.queue_wait_ms for r in timed], 50) if timed else float("nan"),
        engine_p50_ms=percentile([r.inference_ms for r in timed], 50) if timed else float("nan"),
    )


def poisson_arrivals(rate_qps: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets (s from the start) of a Poisson process of ``rate_qps`` over ``duration_s``.

    Exponential gaps from ``numpy.random.default_rng(seed)``: same arguments → same schedule.

    Raises:
        ValueError: a non-positive rate or duration.
    """
    if rate_qps <= 0 or duration_s <= 0:
        raise ValueError("rate_qps and duration_s must be > 0")
    rng = np.random.default_rng(seed)
    out: list[float] = []
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / rate_qps))
        if t >= duration_s:
            return out
        out.append(t)
