"""The canary guard's pure core: finished-request outcomes in, per-version figures and a verdict out.

No Redis, no clock: :func:`canary_verdict` takes the samples of one window and the bounds
(``models.<m>.canary`` settings). :mod:`protocol.model_state` reads the window from Redis and acts
on the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from protocol.settings import CanarySettings

__all__ = [
    "Outcome",
    "Verdict",
    "VersionFigures",
    "canary_verdict",
    "percentile",
    "unserved_canary_verdict",
    "version_figures",
]

Role = Literal["stable", "canary"]


@dataclass(frozen=True)
class Outcome:
    """One finished request: which version computed it, for which role, whether it succeeded.

    ``latency_ms`` is enqueue to result (ms); ``at_unix_s`` is when it finished (wall time, s).
    """

    version: str
    role: Role
    ok: bool
    latency_ms: float
    at_unix_s: float


@dataclass(frozen=True)
class VersionFigures:
    """One version's figures over a window: requests, failures, error rate, latency p50/p99 (ms)."""

    version: str
    requests: int
    errors: int
    error_rate: float
    p50_ms: float | None
    p99_ms: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (latencies rounded to 0.01 ms, error rate to 4 decimals)."""
        return {
            "version": self.version,
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 4),
            "p50_ms": None if self.p50_ms is None else round(self.p50_ms, 2),
            "p99_ms": None if self.p99_ms is None else round(self.p99_ms, 2),
        }


@dataclass(frozen=True)
class Verdict:
    """What the guard concluded: ``rollback`` with its ``reason``, and the figures it judged."""

    rollback: bool
    reason: str | None
    canary: VersionFigures | None
    stable: VersionFigures | None

    def figures(self) -> dict[str, Any]:
        """The measured figures, as recorded in the history entry of an automatic rollback."""
        return {
            "canary": self.canary.to_dict() if self.canary else None,
            "stable": self.stable.to_dict() if self.stable else None,
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0 < q <= 100) of ``values``; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def version_figures(samples: Iterable[Outcome]) -> dict[str, VersionFigures]:
    """Figures per version (whatever role each request had), in the order versions first appear."""
    latencies: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for sample in samples:
        latencies.setdefault(sample.version, []).append(sample.latency_ms)
        errors[sample.version] = errors.get(sample.version, 0) + (0 if sample.ok else 1)
    return {
        version: VersionFigures(
            version=version,
            requests=len(values),
            errors=errors[version],
            error_rate=errors[version] / len(values),
            p50_ms=percentile(values, 50),
            p99_ms=percentile(values, 99),
        )
        for version, values in latencies.items()
    }


def canary_verdict(
    samples: Iterable[Outcome], bounds: CanarySettings, *, canary: str, stable: str | None
) -> Verdict:
    """Judge the ``canary`` version against ``bounds`` over one window of ``samples``.

    Figures are per version (a canary-queue request computed by the stable version, as happens just
    after a change, counts for the stable version); with ``stable`` None (no pin) the busiest other
    version is the stable one. No rollback until the canary has
    ``bounds.min_requests`` samples; then it is rolled back when its error rate exceeds
    ``max_error_rate``, its p99 exceeds ``max_p99_ms``, or (when the stable version also has
    ``min_requests``) its p99 exceeds ``max_p99_ratio`` x the stable p99.
    """
    figures = version_figures(samples)
    can = figures.get(canary)
    if stable is None:  # no pin: the stable role serves the configured version, whatever its name
        others = [f for v, f in figures.items() if v != canary]
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
    assert can.p99_ms is not None  # at least min_requests >= 1 samples
    if bounds.max_p99_ms is not None and can.p99_ms > bounds.max_p99_ms:
        reason = f"canary {canary} p99 {can.p99_ms:.1f} ms > max_p99_ms {bounds.max_p99_ms}"
        return Verdict(True, reason, can, sta)
    if (
        bounds.max_p99_ratio is not None
        and sta is not None
        and sta.requests >= bounds.min_requests
        and sta.p99_ms
        and can.p99_ms > bounds.max_p99_ratio * sta.p99_ms
    ):
        reason = (
            f"canary {canary} p99 {can.p99_ms:.1f} ms > max_p99_ratio {bounds.max_p99_ratio} x stable "
            f"{sta.version} p99 {sta.p99_ms:.1f} ms"
        )
        return Verdict(True, reason, can, sta)
    return Verdict(False, None, can, sta)


def unserved_canary_verdict(
    verdict: Verdict, samples: Sequence[Outcome], canary: str, refused: Sequence[tuple[str, str]], min_requests: int
) -> Verdict:
    """``verdict``, or a rollback when the canary cannot be loaded anywhere its traffic goes.

    Workers run a canary-queue request on stable while they have no canary loaded, so a canary that
    every worker refused (a checksum mismatch, a load error) would stay "in force" forever while
    serving nothing, and the error-rate bounds would never see it. Rolled back when at least one
    worker refused ``canary`` since it was set (``refused``: (worker, "ErrorType: message") pairs),
    at least ``min_requests`` canary-role requests finished in the window, and none of them was
    computed by ``canary``.
    """
    if verdict.rollback or not refused:
        return verdict
    canary_role = [s for s in samples if s.role == "canary"]
    if len(canary_role) < min_requests or any(s.version == canary for s in canary_role):
        return verdict
    workers = sorted({worker for worker, _ in refused})
    return replace(verdict, rollback=True, reason=(
        f"canary {canary} was refused by {len(workers)} worker(s) ({', '.join(workers[:5])}) and computed none of "
        f"the {len(canary_role)} canary requests in the window (stable served them): {refused[-1][1][:300]}"
    ))
