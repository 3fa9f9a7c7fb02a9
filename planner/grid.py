"""Run the model for every combination of autoscaler settings (a grid), with a progress bar."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from planner.model import FleetShape, Outcome, simulate
from planner.scaler import ScalerSettings
from planner.service import ServiceTimes
from planner.trace import Trace

__all__ = ["GridRow", "best_row", "run_grid"]


@dataclass(frozen=True)
class GridRow:
    """One setting of the grid and what the model measured for it."""

    scaler: ScalerSettings
    outcome: Outcome

    def to_json(self) -> dict[str, Any]:
        """The row as figures (ms, requests, replica-minutes)."""
        s, o = self.scaler, self.outcome
        return {"list_length": s.list_length, "polling_interval_s": s.polling_interval_s,
                "min_replicas": s.min_replicas, "idle_replicas": s.idle_replicas, "max_replicas": s.max_replicas,
                "cooldown_s": s.cooldown_s,
                "p50_queue_wait_ms": round(o.percentile_ms(50), 1), "p99_queue_wait_ms": round(o.percentile_ms(99), 1),
                "refused": o.refused, "replica_minutes": round(o.replica_minutes, 1), "peak_replicas": o.max_replicas}


def run_grid(trace: Trace, service: ServiceTimes, shape: FleetShape, base: ScalerSettings, *,
             list_lengths: Sequence[int], polling_intervals_s: Sequence[float], min_replicas: Sequence[int],
             progress: bool = True) -> list[GridRow]:
    """The model once per (listLength, pollingInterval, minReplicaCount); other settings from ``base``.

    A ``minReplicaCount`` above 0 is paired with ``idleReplicaCount: 0`` (activation from zero kept).
    """
    combos = list(itertools.product(list_lengths, polling_intervals_s, min_replicas))
    rows = []
    for length, poll_s, low in tqdm(combos, desc="fleet plan", unit="setting", disable=not progress):
        # minReplicaCount > 0 comes with idleReplicaCount 0: the fleet still sleeps at zero when idle.
        scaler = replace(base, list_length=length, polling_interval_s=poll_s, min_replicas=low,
                         idle_replicas=0 if low > 0 else None)
        rows.append(GridRow(scaler, simulate(trace, service, shape, scaler)))
    return rows


def best_row(rows: Sequence[GridRow], slo_p99_ms: float) -> GridRow | None:
    """The cheapest row (replica-minutes) that refuses nothing and keeps p99 queue wait within ``slo_p99_ms``.

    Ties (same cost and p99) go to the longer pollingInterval and the larger listLength: the same
    outcome for fewer KEDA polls of Redis and fewer scale-ups on a short spike.
    """
    fit = [r for r in rows if r.outcome.refused == 0 and r.outcome.percentile_ms(99) <= slo_p99_ms]
    return min(fit, key=lambda r: (round(r.outcome.replica_minutes, 1), round(r.outcome.percentile_ms(99), 1),
                                   -r.scaler.polling_interval_s, -r.scaler.list_length), default=None)
