"""Pure statistics of generation runs: per-request records, run summaries, step shares, metric deltas.

No I/O and no clocks: every time is passed in (seconds from ``time.perf_counter``, or milliseconds
as the worker reported them), so each function is tested with plain tables.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.stats import LatencySummary, summarize_latencies

if TYPE_CHECKING:
    from protocol.messages import InferenceResult

__all__ = [
    "GenRecord",
    "GenSummary",
    "arrival_offsets",
    "metric_delta",
    "parse_metrics",
    "step_shares",
    "summarize_generation",
]

NAN = float("nan")


@dataclass(frozen=True)
class GenRecord:
    """One generate request as the load generator saw it (``perf_counter`` s; worker figures in ms)."""

    submit_s: float
    done_s: float
    prompt_tokens: int
    completion_tokens: int = 0
    ttft_ms: float = NAN
    """Producer submit → first token (the worker's figure)."""
    inter_token_ms: float = NAN
    """The request's mean gap between consecutive tokens (NaN for a single token)."""
    queue_wait_ms: float = NAN
    """Producer submit → its prefill started."""
    batch_mean: float = NAN
    """Mean running batch over its decode steps."""
    error: str | None = None

    @classmethod
    def from_result(cls, submit_s: float, done_s: float, result: InferenceResult) -> GenRecord:
        """A finished generation, with the worker's own timings.

        Raises:
            ValueError: ``result`` is not a generation.
        """
        gen = result.generation
        if gen is None:
            raise ValueError(f"result {result.request_id} carries no generation (kind {result.kind})")
        t = gen.timings
        return cls(
            submit_s, done_s, result.input_tokens, gen.usage.completion_tokens, t.time_to_first_token_ms,
            t.mean_inter_token_ms if gen.usage.completion_tokens > 1 else NAN, result.timings.queue_wait_ms,
            t.batch_size_mean,
        )  # fmt: skip

    @property
    def latency_ms(self) -> float:
        """Submit → result available (ms)."""
        return 1000.0 * (self.done_s - self.submit_s)


@dataclass(frozen=True)
class GenSummary:
    """What one generation run measured."""

    requests: int
    errors: int
    tokens: int
    """Generated tokens of the successful requests."""
    span_s: float
    """First submit → last result."""
    tokens_per_s: float
    requests_per_s: float
    ttft: LatencySummary
    inter_token: LatencySummary
    """Over the requests' mean inter-token gaps."""
    latency: LatencySummary
    """Submit → result available, as the client saw it."""
    queue_wait_p50_ms: float
    mean_batch: float
    """Token-weighted mean running batch the requests were decoded in."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view."""
        return asdict(self)


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def summarize_generation(runs: Sequence[Sequence[GenRecord]]) -> GenSummary:
    """Pool runs of one configuration: tokens/s = all their tokens / the sum of each run's span
    (first submit → last result); latency distributions over every request."""
    records = [r for run in runs for r in run]
    ok = [r for r in records if r.error is None]
    span = max(sum(max(r.done_s for r in run) - min(r.submit_s for r in run) for run in runs if run), 1e-9)
    tokens = sum(r.completion_tokens for r in ok)
    weighted = [(r.batch_mean, r.completion_tokens) for r in ok if not math.isnan(r.batch_mean)]
    weight = sum(w for _, w in weighted)
    waits = _finite(r.queue_wait_ms for r in ok)
    return GenSummary(
        requests=len(ok),
        errors=len(records) - len(ok),
        tokens=tokens,
        span_s=span if records else 0.0,
        tokens_per_s=tokens / span if ok else 0.0,
        requests_per_s=len(ok) / span if ok else 0.0,
        ttft=summarize_latencies(_finite(r.ttft_ms for r in ok)),
        inter_token=summarize_latencies(_finite(r.inter_token_ms for r in ok)),
        latency=summarize_latencies([r.latency_ms for r in ok]),
        queue_wait_p50_ms=float(np.percentile(waits, 50)) if waits else NAN,
        mean_batch=sum(b * w for b, w in weighted) / weight if weight else NAN,
    )


def arrival_offsets(rate_qps: float | None, count: int, seed: int) -> list[float]:
    """Submit times (s from the start) of ``count`` requests: Poisson arrivals of ``rate_qps`` (seeded
    exponential gaps, the first after one gap), or all at once (every offset 0) when ``rate_qps`` is None.

    Raises:
        ValueError: a non-positive rate or a negative count.
    """
    if count < 0 or (rate_qps is not None and rate_qps <= 0):
        raise ValueError("count must be >= 0 and rate_qps > 0 (or None)")
    if rate_qps is None:
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_qps, size=count)
    return [float(x) for x in np.cumsum(gaps)]


def step_shares(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Where the generation loop's step time went, from its observed steps.

    Each step maps ``prefill_ms``, ``copy_ms``, ``decode_ms``, ``running`` (rows decoded) and
    ``tokens``, and optionally ``kv_tokens`` (real tokens in the cache) and ``kv_slots`` (rows x cache
    width). Returns the shares of prefill, cache re-layout (copy) and decode in the summed step time,
    the mean decode batch, the number of steps and of re-layouts, ms per re-layout, and the cache's
    fill (real tokens / slots over the decoding steps; NaN without slots).
    """
    prefill = sum(s["prefill_ms"] for s in steps)
    copy = sum(s["copy_ms"] for s in steps)
    decode = sum(s["decode_ms"] for s in steps)
    total = prefill + copy + decode
    decoding = [s["running"] for s in steps if s["running"] > 0]
    changes = sum(1 for s in steps if s["copy_ms"] > 0)
    slots = sum(s.get("kv_slots", 0.0) for s in steps if s["running"] > 0)
    real = sum(s.get("kv_tokens", 0.0) for s in steps if s["running"] > 0)
    return {
        "steps": float(len(steps)),
        "step_ms_total": total,
        "prefill_share": prefill / total if total > 0 else NAN,
        "copy_share": copy / total if total > 0 else NAN,
        "decode_share": decode / total if total > 0 else NAN,
        "mean_running": sum(decoding) / len(decoding) if decoding else NAN,
        "relayouts": float(changes),
        "copy_ms_per_relayout": copy / changes if changes else NAN,
        "tokens": float(sum(s["tokens"] for s in steps)),
        "kv_fill": real / slots if slots > 0 else NAN,
    }


def parse_metrics(text: str, names: Iterable[str]) -> dict[str, float]:
    """Values of the Prometheus samples ``names`` in an exposition ``text``, summed over label sets
    (0 for a sample that is absent). Lines are ``name{labels} value`` or ``name value``."""
    wanted = {n: 0.0 for n in names}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        if name in wanted:
            try:
                wanted[name] += float(value)
            except ValueError:
                continue
    return wanted


def metric_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` for every sample of ``after``."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
