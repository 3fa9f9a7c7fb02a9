"""The limit: the same model in a tight ``session.run`` loop, no queue, no Celery, no Redis.

The session is built with the worker's options (all graph optimizations, ORT-chosen thread count,
spin-waiting as configured) and fed pre-padded batches of the workload's prompts, cycling, so
the only work left is the forward pass plus fetching ``logits``: the ceiling the fleet is
measured against.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnxruntime as ort

from protocol.modelcard import ModelCard
from tools.calibration import feeds_for

__all__ = ["LimitPoint", "bare_latency_ms", "bare_session", "bare_throughput"]


@dataclass(frozen=True)
class LimitPoint:
    """Throughput of the bare loop at one batch size."""

    batch_size: int
    qps: float
    """Requests (rows) per second."""
    batch_ms: float
    """Mean time of one ``session.run`` (ms)."""
    runs: int


def bare_session(model_path: Path, *, spinning: bool = False, threads: int = 0) -> ort.InferenceSession:
    """A CPU session with the worker's options (``spinning`` = ORT intra-op spin-waiting)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    flag = "1" if spinning else "0"
    opts.add_session_config_entry("session.intra_op.allow_spinning", flag)
    opts.add_session_config_entry("session.inter_op.allow_spinning", flag)
    opts.log_severity_level = 3
    return ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])


def _batches(
    sess: ort.InferenceSession, card: ModelCard, prompts: Sequence[Sequence[int]], batch_size: int
) -> list[dict[str, npt.NDArray[Any]]]:
    names = [i.name for i in sess.get_inputs()]
    groups = [prompts[i : i + batch_size] for i in range(0, len(prompts) - batch_size + 1, batch_size)]
    if not groups:
        groups = [list(prompts[:batch_size]) * max(1, batch_size // max(1, len(prompts)))]
    return [feeds_for(names, card, g) for g in groups]


def bare_throughput(
    sess: ort.InferenceSession,
    card: ModelCard,
    prompts: Sequence[Sequence[int]],
    batch_size: int,
    *,
    duration_s: float,
    min_runs: int = 3,
) -> LimitPoint:
    """Run batches of ``batch_size`` prompts back to back for ``duration_s`` (at least ``min_runs``).

    One untimed run first (allocations). Returns rows per second and mean ms per run.
    """
    feeds = _batches(sess, card, prompts, batch_size)
    sess.run(["logits"], feeds[0])
    runs = 0
    start = time.perf_counter()
    while runs < min_runs or time.perf_counter() - start < duration_s:
        sess.run(["logits"], feeds[runs % len(feeds)])
        runs += 1
    elapsed = time.perf_counter() - start
    rows = sum(int(feeds[i % len(feeds)]["input_ids"].shape[0]) for i in range(runs))
    return LimitPoint(batch_size, rows / elapsed, 1000 * elapsed / runs, runs)


def bare_latency_ms(sess: ort.InferenceSession, card: ModelCard, prompts: Sequence[Sequence[int]]) -> float:
    """Median ms of one ``session.run`` of one prompt (batch 1), over ``prompts`` in order."""
    names = [i.name for i in sess.get_inputs()]
    feeds = [feeds_for(names, card, [p]) for p in prompts]
    sess.run(["logits"], feeds[0])
    times = []
    for f in feeds:
        start = time.perf_counter()
        out = sess.run(["logits"], f)
        times.append(1000 * (time.perf_counter() - start))
        del out
    return float(statistics.median(times))
