"""The canary guard's pure core: finished-request outcomes in, per-version figures and a verdict out.

No Redis, no clock: :func:`canary_verdict` takes the samples of one window and the bounds
(``models.<m>.canary`` settings). :mod:`protocol.model_state` reads the window from Redis and acts
on the verdict.

Latency is judged at the highest percentile the sample supports (:func:`supported_percentile`): a
nearest-rank p99 of fewer than 100 requests is their maximum, so one slow request (a GC pause) would
decide the verdict. With fewer, the canary is judged at p95 (20 requests or more), p90 (10), p75 (4) or
p50 (2): a percentile that is never the sample's maximum. The verdict's reason and figures
(``latency_judged``) name the percentile used. Judging a lower percentile against ``max_p99_ms`` only
errs towards keeping the canary (its p99 is at least its p90). Per-version figures
(:class:`VersionFigures`, ``fleet models compare``) follow the same rule: no p99 below 100 requests,
and the tail at the percentile the requests support, named.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from protocol.settings import CanarySettings

__all__ = [
    "PERCENTILE_LADDER",
    "JudgedLatency",
    "Outcome",
    "Verdict",
    "VersionFigures",
    "canary_verdict",
    "percentile",
    "supported_percentile",
    "unserved_canary_verdict",
    "version_figures",
]

Role = Literal["stable", "canary"]

PERCENTILE_LADDER = (99, 95, 90, 75, 50)
"""The latency percentiles the guard may judge, the highest first (see :func:`supported_percentile`)."""


@dataclass(frozen=True)
class Outcome:
    """One finished request: which version computed it, for which role, whether it succeeded.

    ``latency_ms`` is enqueue to result (ms); ``at_unix_s`` is when it finished (wall time, s).
    ``asked``: the role its queue asked for (a canary-queue request runs on stable while no canary is
    loaded: role stable, asked canary); None = ``role`` (entries written before the field).
    """

    version: str
    role: Role
    ok: bool
    latency_ms: float
    at_unix_s: float
    asked: Role | None = None

    @property
    def queue_role(self) -> Role:
        """The role of the queue the request came from."""
        return self.asked or self.role


@dataclass(frozen=True)
class VersionFigures:
    """One version's figures over a window: requests, failures, error rate, latency (ms, enqueue to result).

    ``p99_ms`` is None below 100 requests (a nearest-rank p99 of fewer is their maximum, see
    :func:`supported_percentile`); ``tail_percentile`` / ``tail_ms`` are the highest percentile the requests
    support and its value (p99 from 100, p95 from 20, … p50 from 2; None below 2), the one the canary guard
    judges; ``max_ms`` is the slowest request, named as such. ``p50_ms`` of one request is that request.
    """

    version: str
    requests: int
    errors: int
    error_rate: float
    p50_ms: float | None
    p99_ms: float | None
    tail_ms: float | None = None
    max_ms: float | None = None

    @property
    def tail_percentile(self) -> int | None:
        """The highest percentile ``requests`` support (:func:`supported_percentile`); None below 2."""
        return supported_percentile(self.requests)

    @property
    def tail_label(self) -> str:
        """The tail in words, e.g. ``p95 (n=40)``, or ``n/a (n=1; needs 2)``."""
        if self.tail_percentile is None:
            return f"n/a (n={self.requests}; needs 2)"
        return f"p{self.tail_percentile} (n={self.requests})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (latencies rounded to 0.01 ms, error rate to 4 decimals). The keys up to
        ``p99_ms`` are the original ones (``p99_ms`` null below 100 requests); ``tail_*`` and ``max_ms`` were
        added beside them."""
        return {
            "version": self.version,
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 4),
            "p50_ms": _ms(self.p50_ms),
            "p99_ms": _ms(self.p99_ms),
            "tail": self.tail_label,
            "tail_percentile": self.tail_percentile,
            "tail_ms": _ms(self.tail_ms),
            "max_ms": _ms(self.max_ms),
        }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


@dataclass(frozen=True)
class JudgedLatency:
    """The latency percentile a verdict compared (see :func:`supported_percentile`) and its values (ms);
    ``stable_ms`` None when the stable version was not compared (too few requests, or no ratio bound)."""

    percentile: int
    canary_ms: float
    stable_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (latencies rounded to 0.01 ms)."""
        return {"percentile": self.percentile, "canary_ms": round(self.canary_ms, 2),
                "stable_ms": None if self.stable_ms is None else round(self.stable_ms, 2)}


@dataclass(frozen=True)
class Verdict:
    """What the guard concluded: ``rollback`` with its ``reason``, and the figures it judged.

    ``latency``: the percentile the latency bounds were checked at (None when they were not checked);
    ``canary_queue``: per version, the canary-role requests, when versions other than the canary
    computed them (a canary nobody loaded: :func:`unserved_canary_verdict`).
    """

    rollback: bool
    reason: str | None
    canary: VersionFigures | None
    stable: VersionFigures | None
    latency: JudgedLatency | None = None
    canary_queue: tuple[VersionFigures, ...] = ()

    def figures(self) -> dict[str, Any]:
        """The measured figures, as recorded in the history entry of an automatic rollback."""
        doc: dict[str, Any] = {
            "canary": self.canary.to_dict() if self.canary else None,
            "stable": self.stable.to_dict() if self.stable else None,
        }
        if self.latency is not None:
            doc["latency_judged"] = self.latency.to_dict()
        if self.canary_queue:
            doc["canary_queue"] = [f.to_dict() for f in self.canary_queue]
        return doc


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0 < q <= 100) of ``values``; None for no values.

    With fewer than ``100 / (100 - q)`` values it is their maximum (p99 of 99 values or fewer): see
    :func:`supported_percentile` before judging a tail with it."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def supported_percentile(requests: int) -> int | None:
    """The highest percentile of :data:`PERCENTILE_LADDER` that ``requests`` samples support, pure: ``q`` such
    that ``requests >= 100 / (100 - q)`` (p99: 100, p95: 20, p90: 10, p75: 4, p50: 2), so that its nearest
    rank is below the maximum and one outlier cannot be it. None for fewer than 2 samples."""
    for q in PERCENTILE_LADDER:
        if requests * (100 - q) >= 100:
            return q
    return None


def _why_percentile(q: int, requests: int) -> str:
    """The reason's note on a percentile lower than p99 (empty for p99)."""
    return "" if q == 99 else f" (p{q}: the highest percentile {requests} requests support; p99 needs 100)"


def version_figures(samples: Iterable[Outcome]) -> dict[str, VersionFigures]:
    """Figures per version (whatever role each request had), in the order versions first appear; latency
    percentiles by nearest rank, the tail at the percentile each version's requests support."""
    latencies: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for sample in samples:
        latencies.setdefault(sample.version, []).append(sample.latency_ms)
        errors[sample.version] = errors.get(sample.version, 0) + (0 if sample.ok else 1)
    return {version: _figures(version, values, errors[version]) for version, values in latencies.items()}


def _figures(version: str, latencies_ms: Sequence[float], errors: int) -> VersionFigures:
    n = len(latencies_ms)
    tail = supported_percentile(n)
    return VersionFigures(
        version=version,
        requests=n,
        errors=errors,
        error_rate=errors / n,
        p50_ms=percentile(latencies_ms, 50),
        p99_ms=percentile(latencies_ms, 99) if tail == 99 else None,
        tail_ms=percentile(latencies_ms, tail) if tail is not None else None,
        max_ms=max(latencies_ms),
    )


def canary_verdict(
    samples: Iterable[Outcome], bounds: CanarySettings, *, canary: str, stable: str | None
) -> Verdict:
    """Judge the ``canary`` version against ``bounds`` over one window of ``samples``.

    Figures are per version (a canary-queue request computed by the stable version, as happens just
    after a change, counts for the stable version); with ``stable`` None (no pin) the busiest other
    version that computed stable-role requests is the stable one. No rollback until the canary has
    ``bounds.min_requests`` samples; then it is rolled back when its error rate exceeds
    ``max_error_rate``, its latency exceeds ``max_p99_ms``, or (when the stable version also has
    ``min_requests``) its latency exceeds ``max_p99_ratio`` x the stable one's. Latency is compared at
    the highest percentile the samples support (:func:`supported_percentile`: p99 from 100 requests;
    for the ratio, the percentile both versions' samples support), never at a sample's maximum.
    """
    samples = list(samples)
    figures = version_figures(samples)
    can = figures.get(canary)
    if stable is None:  # no pin: the stable role serves the configured version, whatever its name
        stable_role = {s.version for s in samples if s.role == "stable"}
        others = [f for v, f in figures.items() if v != canary and v in stable_role]
        others = others or [f for v, f in figures.items() if v != canary]
        sta = max(others, key=lambda f: f.requests) if others else None
    else:
        sta = figures.get(stable) if stable != canary else None
    if can is None or can.requests < bounds.min_requests:
        return Verdict(False, None, can, sta)
    if can.error_rate > bounds.max_error_rate:
        reason = (
            f"canary {canary} error rate {can.error_rate:.3f} ({can.errors}/{can.requests}) > "
            f"max_error_rate {bounds.max_error_rate}"
        )
        return Verdict(True, reason, can, sta)
    q = supported_percentile(can.requests)
    if q is None:  # a single request: no latency percentile means anything
        return Verdict(False, None, can, sta)
    latencies = _latencies(samples)
    can_q = percentile(latencies[canary], q)
    assert can_q is not None  # at least 2 samples
    judged = JudgedLatency(q, can_q)
    if bounds.max_p99_ms is not None and can_q > bounds.max_p99_ms:
        reason = (f"canary {canary} p{q} {can_q:.1f} ms > max_p99_ms {bounds.max_p99_ms}"
                  f"{_why_percentile(q, can.requests)}")
        return Verdict(True, reason, can, sta, judged)
    q_both = supported_percentile(min(can.requests, sta.requests)) if sta is not None else None
    if bounds.max_p99_ratio is not None and sta is not None and sta.requests >= bounds.min_requests and q_both:
        can_r, sta_r = percentile(latencies[canary], q_both), percentile(latencies[sta.version], q_both)
        assert can_r is not None and sta_r is not None
        judged = JudgedLatency(q_both, can_r, sta_r)
        if sta_r > 0 and can_r > bounds.max_p99_ratio * sta_r:
            reason = (
                f"canary {canary} p{q_both} {can_r:.1f} ms > max_p99_ratio {bounds.max_p99_ratio} x stable "
                f"{sta.version} p{q_both} {sta_r:.1f} ms{_why_percentile(q_both, min(can.requests, sta.requests))}"
            )
            return Verdict(True, reason, can, sta, judged)
    return Verdict(False, None, can, sta, judged)


def _latencies(samples: Iterable[Outcome]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for sample in samples:
        out.setdefault(sample.version, []).append(sample.latency_ms)
    return out


def unserved_canary_verdict(
    verdict: Verdict, samples: Sequence[Outcome], canary: str, refused: Sequence[tuple[str, str]], min_requests: int
) -> Verdict:
    """``verdict``, or a rollback when the canary cannot be loaded anywhere its traffic goes.

    Workers run a canary-queue request on stable while they have no canary loaded, so a canary that
    every worker refused (a checksum mismatch, a load error) would stay "in force" forever while
    serving nothing, and the error-rate bounds would never see it. Rolled back when at least one
    worker refused ``canary`` since it was set (``refused``: (worker, "ErrorType: message") pairs),
    at least ``min_requests`` canary-role requests finished in the window, and none of them was
    computed by ``canary`` (canary-role requests: those of the canary queue, :attr:`Outcome.queue_role`,
    whatever engine computed them). The reason names the versions that did compute them, and the verdict's
    ``canary_queue`` holds their figures over those requests (the stable version, or a canary the
    state replaced that a worker still held).
    """
    if verdict.rollback or not refused:
        return verdict
    canary_role = [s for s in samples if s.queue_role == "canary"]
    if len(canary_role) < min_requests or any(s.version == canary for s in canary_role):
        return verdict
    workers = sorted({worker for worker, _ in refused})
    stable = verdict.stable.version if verdict.stable is not None else None
    served = ", ".join(f"{'stable ' if version == stable else ''}{version}: {n}"
                       for version, n in Counter(s.version for s in canary_role).most_common())
    return replace(verdict, rollback=True, canary_queue=tuple(version_figures(canary_role).values()), reason=(
        f"canary {canary} was refused by {len(workers)} worker(s) ({', '.join(workers[:5])}) and computed none of "
        f"the {len(canary_role)} canary requests in the window (computed by {served}): {refused[-1][1][:300]}"
    ))
