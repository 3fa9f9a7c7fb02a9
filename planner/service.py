"""Per-batch service time by batch size, from ``docs/benchmarks.json`` or a small JSON of its own.

Accepted files:

- ``fleet bench``'s ``docs/benchmarks.json``: the ``limit`` section's points of one series, named
  ``VARIANT/LENGTH`` (e.g. ``fp32/long``, ``int8/short``): ``batch_ms`` per ``batch_size``;
- ``{"batch_ms": {"1": 14.1, "8": 66.8}}``: milliseconds per batch size.

Below the smallest measured size the time is that size's; between measured sizes it is interpolated
linearly; past the largest it grows linearly with the last segment's slope (never below the largest measured time).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ServiceTimes", "load_service_times"]


@dataclass(frozen=True)
class ServiceTimes:
    """Engine time of one batch (ms) by batch size (sequences)."""

    points: tuple[tuple[int, float], ...]
    """(batch size, ms) pairs, sizes ascending and distinct."""

    def __post_init__(self) -> None:
        sizes = [n for n, _ in self.points]
        if not self.points or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"service times need distinct ascending batch sizes >= 1, got {sizes}")
        if any(ms <= 0 for _, ms in self.points):
            raise ValueError(f"batch_ms must be > 0, got {[ms for _, ms in self.points]}")

    def batch_ms(self, size: int) -> float:
        """Milliseconds one batch of ``size`` sequences takes on the engine."""
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1]
        for (n0, ms0), (n1, ms1) in itertools.pairwise(pts):
            if size <= n1:
                return ms0 + (ms1 - ms0) * (size - n0) / (n1 - n0)
        if len(pts) == 1:
            return pts[0][1] * size / pts[0][0]
        (n0, ms0), (n1, ms1) = pts[-2], pts[-1]
        return max(ms1, ms1 + (ms1 - ms0) * (size - n1) / (n1 - n0))

    def table(self, max_size: int) -> list[float]:
        """``batch_ms`` for sizes 0..max_size (index = size; index 0 is 0.0), for fast lookups."""
        return [0.0] + [self.batch_ms(n) for n in range(1, max_size + 1)]


def _from_points(points: dict[int, float], where: str) -> ServiceTimes:
    try:
        return ServiceTimes(tuple(sorted(points.items())))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def load_service_times(path: Path, series: str = "fp32/long") -> ServiceTimes:
    """Read service times from ``path`` (see the module docstring); ``series`` picks a benchmarks.json series."""
    doc: Any = json.loads(path.read_text())
    if isinstance(doc, dict) and isinstance(doc.get("batch_ms"), dict):
        try:
            return _from_points({int(k): float(v) for k, v in doc["batch_ms"].items()}, f"{path}: batch_ms")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: field 'batch_ms' must map batch sizes to milliseconds ({exc})") from exc
    variant, _, length = series.partition("/")
    try:
        points = doc["limit"][variant][length]["points"]
    except (KeyError, TypeError) as exc:
        have = sorted(f"{v}/{n}" for v, by in (doc.get("limit") or {}).items() if isinstance(by, dict) for n in by) \
            if isinstance(doc, dict) else []
        raise ValueError(f"{path}: no series {series!r} under 'limit' (have {have})") from exc
    return _from_points({int(p["batch_size"]): float(p["batch_ms"]) for p in points}, f"{path}: limit.{series}")
