"""Why a live worker is not ready, in words, from its heartbeat (``fleet:worker:<hostname>``, whose
``not_ready`` field the worker writes itself: :func:`workers.progress.not_ready_reason`).

Read by ``fleet probe ready --worker`` (:mod:`producer.ops_cli`) and by the gateway's ``/readyz``
(:mod:`gateway.ops_routes`), so both say the same thing of the same worker. Pure: no Redis.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["not_ready_reason", "not_ready_reasons"]


def not_ready_reason(worker: str, beat: dict[str, Any]) -> str:
    """Why a live worker's heartbeat says not ready: it is shutting down, else its ``not_ready`` (a thread died,
    its engine fails every run, it holds work it does not progress...); a heartbeat without one: a stall or a
    start."""
    if beat.get("shutting_down"):
        return f"worker {worker!r} is shutting down (draining what it holds; it takes nothing new)"
    if isinstance(beat.get("not_ready"), str):  # the worker's own words (workers.progress.not_ready_reason)
        return f"worker {worker!r} is not ready: {beat['not_ready']}"
    stalled_s = beat.get("stalled_s")
    if isinstance(stalled_s, int | float) and stalled_s > 0:
        holds = f"holds {beat['held']} requests" if beat.get("held") else "has a non-empty queue"
        return (f"worker {worker!r} {holds} and made no progress for {stalled_s:.0f} s (worker.stall_after_s): "
                "it is not progressing the work it holds")
    return f"worker {worker!r} is alive but not ready (loading or warming up)"


def not_ready_reasons(beats: Iterable[dict[str, Any]]) -> list[str]:
    """:func:`not_ready_reason` of each heartbeat in ``beats`` that does not say ready, in order."""
    return [not_ready_reason(str(beat.get("hostname")), beat) for beat in beats if not beat.get("ready")]
