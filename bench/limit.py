"""The limit: the same model in a tight ``session.run`` loop, no queue, no Celery, no Redis.

The session is built with the worker's options (all graph optimizations, ORT-chosen thread count,
spin-waiting as configured) and fed pre-padded batches of the workload's prompts, cycling, so
the only work left is the forward pass plus fetching ``logits``: the ceiling the fleet is
measured against.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy.typing as npt
import onnxruntime as ort

from protocol.modelcard import ModelCard, load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings, ModelSettings
from tools.calibration import feeds_for
from workers.engine import graph_input_names, provider_chain, serving_graph, session_options
from workers.engines import served_source
from workers.kv_dtype import session_kv_dtype
from workers.ort_session import open_session

__all__ = ["LimitPoint", "bare_latency_ms", "bare_parts", "bare_session", "bare_throughput"]


@dataclass(frozen=True)
class LimitPoint:
    """Throughput of the bare loop at one batch size."""

    batch_size: int
    qps: float
    """Requests (rows) per second."""
    batch_ms: float
    """Mean time of one ``session.run`` (ms)."""
    runs: int


def bare_parts(
    model_path: Path,
    *,
    spinning: bool = False,
    threads: int = 0,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    max_batch_size: int = 16,
    max_input_tokens: int = 256,
) -> tuple[str | bytes, Callable[[], ort.SessionOptions], list[tuple[str, dict[str, Any]]]]:
    """What a worker would open for ``model_path``: the served graph, its session options, its provider chain.

    The graph is :func:`workers.engines.served_source`'s on the CPU chain (a causal LM's head at the last
    position when the workers' default ``lm_head_last`` applies, its attention in place when the workers'
    ``kv_cache: auto`` puts it there), :func:`workers.engine.serving_graph`'s on a GPU chain (which keeps
    the Concat cache), the providers are ``providers`` each with
    the worker's options (TensorRT profiles up to ``max_batch_size`` x ``max_input_tokens``);
    ``spinning`` = ORT intra-op spin-waiting.
    """
    card = load_card(model_path)
    engine = EngineSettings(providers=list(providers), intra_op_threads=threads, allow_spinning=spinning)
    names = graph_input_names(model_path) if "TensorrtExecutionProvider" in providers else []
    batching = BatchingSettings(max_batch_size=max_batch_size, max_batch_tokens=max_batch_size * max_input_tokens)
    limits = LimitSettings(max_input_tokens=max_input_tokens)
    chain = provider_chain(engine, batching, limits, card, names)
    if card.kind == "causal_lm" and tuple(providers) == ("CPUExecutionProvider",):  # the in-place decision opens it
        source = served_source(ModelSettings(path=model_path, engine=engine, batching=batching, limits=limits), card)
    else:
        source, _ = serving_graph(model_path, engine, card)
    return source, lambda: session_options(engine), chain


def bare_session(
    model_path: Path,
    *,
    spinning: bool = False,
    threads: int = 0,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    max_batch_size: int = 16,
    max_input_tokens: int = 256,
) -> ort.InferenceSession:
    """A session over the graph the workers serve, with the worker's options and provider chain
    (:func:`bare_parts`), opened step by step as a worker does (:func:`workers.ort_session.open_session`).
    The active providers are in ``session.get_providers()``.
    """
    source, make_options, chain = bare_parts(model_path, spinning=spinning, threads=threads, providers=providers,
                                             max_batch_size=max_batch_size, max_input_tokens=max_input_tokens)
    session, _steps = open_session(source, make_options, chain)
    return session


def _batches(
    sess: ort.InferenceSession, card: ModelCard, prompts: Sequence[Sequence[int]], batch_size: int
) -> list[dict[str, npt.NDArray[Any]]]:
    names, dtype = [i.name for i in sess.get_inputs()], session_kv_dtype(sess)
    groups = [prompts[i : i + batch_size] for i in range(0, len(prompts) - batch_size + 1, batch_size)]
    if not groups:
        groups = [list(prompts[:batch_size]) * max(1, batch_size // max(1, len(prompts)))]
    return [feeds_for(names, card, g, kv_dtype=dtype) for g in groups]


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
    names, dtype = [i.name for i in sess.get_inputs()], session_kv_dtype(sess)
    feeds = [feeds_for(names, card, [p], kv_dtype=dtype) for p in prompts]
    sess.run(["logits"], feeds[0])
    times = []
    for f in feeds:
        start = time.perf_counter()
        out = sess.run(["logits"], f)
        times.append(1000 * (time.perf_counter() - start))
        del out
    return float(statistics.median(times))
