"""The sizes of ``fleet gpu-report``'s phases (:class:`ReportPlan`): the documented run and the smoke run.

Kept apart from :mod:`bench.gpu_report` so that its phases (:mod:`bench.gpu_phases`) and the command share one
plan without importing each other; nothing heavy is imported here (``fleet`` registers ``gpu-report`` at start).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ReportPlan", "Say", "full_report_plan", "quick_report_plan"]

Say = Callable[[str], None]


@dataclass(frozen=True)
class ReportPlan:
    """Sizes of every phase of the report."""

    preset: str = "bench"
    """``tools.build_model`` preset whose LM is served (bench: ~27.6 M weights)."""
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    """Batch sizes of the engine ceiling."""
    ceiling_s: float = 0.6
    """Seconds of bare ``session.run`` per batch size."""
    prompts: int = 256
    prompt_tokens: tuple[int, int] = (8, 48)
    """Token range of the synthetic prompts (the bench's short workload)."""
    max_batch_size: int = 32
    concurrency: int = 64
    """Worker tokens C, and closed-loop clients of the per-request path."""
    max_wait_ms: float = 2.0
    fleet_s: float = 6.0
    """Seconds of each saturation window (per configuration and path)."""
    warmup_s: float = 1.0
    bulk_clients: int = 4
    bulk_chunk: int = 256
    """Requests per ``fleet.infer_bulk`` message."""
    quantize_static: bool = True
    """Also build static QDQ INT8 (the graph TensorRT runs in INT8)."""
    transfer_rows: int = 8
    transfer_steps: int = 32
    graph_rounds: int = 5
    """Rounds of the decode-graphs phase (each variant runs ``transfer_rows`` rows for ``transfer_steps`` steps)."""
    scale_workers: tuple[int, ...] = (1, 2, 4)
    """Worker processes of one model on the one device, started one step after another."""
    scale_processes: int = 4
    """Client processes of the scaling rows (:mod:`bench.load_procs`: one process cannot load several workers)."""
    scale_clients: int = 32
    """Closed-loop client threads per client process."""
    generation: Any = None
    """:class:`bench.plan.GenPlan` of the generation rows (None: the bench's quick plan's)."""
    quick: bool = False


def full_report_plan() -> ReportPlan:
    """The documented run (~5 minutes on a GPU machine)."""
    from bench.plan import GenPlan

    return ReportPlan(
        generation=GenPlan(
            max_batch_size=16, concurrency=32, prompt_tokens=(16, 64), output_tokens=(16, 64), requests=64,
            rounds=1, open_fractions=(0.5,), open_duration_s=3.0, open_min_requests=8, open_max_requests=24,
            warm_requests=2, limit_batch_sizes=(1, 4, 16), limit_steps=32, profile_runs=4,
        )
    )  # fmt: skip


def quick_report_plan() -> ReportPlan:
    """A smoke run (~1–2 minutes on 2 CPU cores): the demo model, short windows."""
    from bench.plan import quick_plan

    return ReportPlan(
        preset="demo", batch_sizes=(1, 8), ceiling_s=0.2, prompts=32, max_batch_size=8, concurrency=16,
        fleet_s=1.5, warmup_s=0.3, bulk_clients=2, bulk_chunk=32, quantize_static=True, transfer_rows=4,
        transfer_steps=8, graph_rounds=2, scale_workers=(1, 2), scale_processes=2, scale_clients=8,
        generation=quick_plan().generation, quick=True,
    )  # fmt: skip
