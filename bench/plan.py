"""How long each phase of the bench runs: the full plan (~18 minutes on 2 cores) and ``--quick``.

Durations are in seconds, request counts in requests. Workloads are the issue's two prompt
shapes: ``long`` (128–256 tokens) and ``short`` (8–16 tokens), and the generation mix
(:class:`GenPlan`: prompts 8–128 tokens, outputs 4–128 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["WORKLOADS", "GenPlan", "Plan", "full_plan", "quick_plan"]

WORKLOADS: dict[str, tuple[int, int]] = {"long": (128, 256), "short": (8, 16)}
"""Workload name → (min, max) prompt length (tokens), uniform."""


@dataclass(frozen=True)
class GenPlan:
    """Sizes of the generation phase (token counts in tokens, durations in seconds)."""

    max_batch_size: int = 16
    """Of the static and continuous rows (the one-at-a-time row runs 1)."""
    concurrency: int = 32
    """Worker tokens C of the static and continuous rows: C > max_batch_size keeps the next joiners
    inside the worker, so a freed slot is refilled at the next step (the one-at-a-time row runs C = 1)."""
    prompt_tokens: tuple[int, int] = (8, 128)
    output_tokens: tuple[int, int] = (4, 128)
    """``max_new_tokens`` range; requests set ``ignore_eos``, so each makes exactly that many."""
    requests: int = 32
    """The saturation workload: all submitted at once."""
    rounds: int = 3
    """Saturation runs per row, the rows' order reversed every other round (pooled)."""
    open_fractions: tuple[float, ...] = (0.25, 0.5, 1.0)
    """Offered loads (Poisson), as fractions of the continuous row's saturation request rate."""
    open_duration_s: float = 8.0
    open_min_requests: int = 6
    open_max_requests: int = 24
    """Requests per offered-load run: rate x duration, clamped to [min, max] (bounds the drain time of an
    overloaded row)."""
    warm_requests: int = 2
    limit_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    limit_steps: int = 0
    """Decode steps per limit point (0 = the workload's mean output length)."""
    profile_runs: int = 10
    """Decode steps under ORT's profiler (at max_batch_size)."""


@dataclass(frozen=True)
class Plan:
    """Sizes of every phase."""

    quick: bool
    preset: str
    """``tools.build_model`` preset whose lm/identity models are served."""
    max_batch_size: int = 8
    concurrency: int = 16
    """Worker tokens C (and closed-loop clients at saturation)."""
    max_wait_ms: float = 2.0
    prompts: int = 256
    """Distinct prompts per workload."""
    lone_requests: dict[str, int] = field(default_factory=lambda: {"long": 15, "short": 45})
    rounds: int = 3
    """Interleaved saturation rounds per configuration (pooled)."""
    sat_duration_s: dict[str, float] = field(default_factory=lambda: {"long": 12.0, "short": 6.0})
    """Measured saturation time per configuration, all rounds together."""
    sat_warmup_s: dict[str, float] = field(default_factory=lambda: {"long": 1.5, "short": 0.8})
    """Ramp-up before each round's window (not counted)."""
    open_fractions: tuple[float, ...] = (0.4, 0.8)
    """Open-loop rates, as fractions of the configuration's own saturation QPS."""
    open_duration_s: dict[str, float] = field(default_factory=lambda: {"long": 6.0, "short": 3.5})
    limit_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    limit_duration_s: float = 1.0
    """Per batch size and pass; the limit is measured before and after the fleet phase (best kept)."""
    dispatch_clients: int = 32
    dispatch_duration_s: float = 8.0
    dispatch_lone_requests: int = 100
    profile_s: float = 6.0
    """py-spy profile of the dispatch loop (0 = none)."""
    peer: bool = True
    same_weights: bool = True
    """The same-weights rows (``bench/same_weights.py``: the fleet against a bare loop and og.Engine)."""
    guidellm: bool = True
    """guidellm's sweep against the gateway (``bench/guidellm_sweep.py``)."""
    ablations: bool = True
    """Extra rows and variants: lean Celery, ORT spin-waiting on, Celery log level INFO, the bulk path
    (``fleet.infer_bulk``), the LM-head-at-last-position model."""
    int8_variants: bool = True
    """Also quantize static QDQ (+ symmetric) for the INT8 variants table."""
    generation: GenPlan = field(default_factory=GenPlan)
    peer_flush_interval_s: float = 0.05
    """celery-batches' flush timer (s): the 50 ms window of the issue's tuned peer."""
    seed: int = 0
    provider: str = "cpu"
    """Execution providers of every phase (limit, workers, generation): ``cpu``, ``cuda`` (CUDA → CPU) or
    ``tensorrt`` (TensorRT → CUDA → CPU); see :data:`bench.machine.BENCH_PROVIDERS`."""


def full_plan(*, peer: bool = True) -> Plan:
    """The documented run: the bench preset (~27.6 M weights), every row, ~18 minutes on 2 cores."""
    return Plan(quick=False, preset="bench", peer=peer)


def quick_plan() -> Plan:
    """The CI smoke run (< ~60 s): the demo preset, short phases, no peer, no ablations."""
    return Plan(
        quick=True,
        preset="demo",
        prompts=32,
        lone_requests={"long": 6, "short": 6},
        rounds=1,
        sat_duration_s={"long": 1.5, "short": 1.5},
        sat_warmup_s={"long": 0.3, "short": 0.3},
        open_fractions=(0.5,),
        open_duration_s={"long": 1.0, "short": 1.0},
        limit_batch_sizes=(1, 8),
        limit_duration_s=0.3,
        dispatch_clients=8,
        dispatch_duration_s=1.5,
        dispatch_lone_requests=20,
        profile_s=0.0,
        peer=False,
        same_weights=False,
        guidellm=False,
        ablations=False,
        int8_variants=False,
        generation=GenPlan(
            max_batch_size=4, concurrency=8, prompt_tokens=(8, 32), output_tokens=(4, 16), requests=8,
            rounds=1, open_fractions=(0.5,), open_duration_s=1.0, open_min_requests=3, open_max_requests=6,
            warm_requests=1, limit_batch_sizes=(1, 4), limit_steps=8, profile_runs=2,
        ),
    )
