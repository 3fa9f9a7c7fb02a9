"""CUDA graphs for the decode steps of the in-place KV cache (``engine.cuda_graph``).

A decode step of a small or mid-sized model launches one kernel per node, and on a fast GPU the
launches, not the arithmetic, set its time. ONNX Runtime's CUDA provider can capture a run as a CUDA
graph and replay it with one launch (``enable_cuda_graph``), on three conditions:

- the CUDA provider runs every compute node (shape arithmetic on the CPU is allowed, a copy between
  devices is not), so a chain with TensorRT ahead of CUDA cannot use it;
- every input and output of the run is bound at the same device address, with the same shape, at every
  replay;
- a run that does not meet those (a prefill, warm-up, the placement run) says so with the run option
  ``gpu_graph_id = -1``.

The in-place cache gives the second: its slot buffers never move, and
:class:`~workers.generation.inplace_decoder.InPlaceDecoder` runs steps over a span of slots on ids,
a mask as wide as the slots' capacity, positions and logits held in fixed device buffers, one set
(and one graph id) per span and cache. :func:`cuda_graph_chain` decides whether the session asks for
graphs, :class:`~workers.engine.Engine` opens it and falls back to a session without them when ONNX
Runtime refuses, and :func:`run_options` names the graph of each run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import onnxruntime as ort

from protocol.settings import GRAPH_CAPTURE_OPTIONS, EngineSettings
from workers.inplace_graph import KVChoice
from workers.ort_session import ProviderStep

__all__ = ["CUDA", "NO_GRAPH", "capture_active", "cuda_graph_chain", "open_capturing", "refusal", "run_options"]

CUDA = "CUDAExecutionProvider"
OPTION = GRAPH_CAPTURE_OPTIONS[CUDA]
NO_GRAPH = -1
"""The ``gpu_graph_id`` of a run that is neither captured nor replayed."""

Chain = list[tuple[str, dict[str, Any]]]


def cuda_graph_chain(chain: Chain, engine: EngineSettings, kv: KVChoice) -> tuple[Chain, str | None]:
    """``chain`` with the CUDA provider asked to capture graphs, or ``chain`` as it is and why not.

    Returns (the chain to open, None) when graphs are asked for; (``chain``, the reason) otherwise. The
    reason is None when ``engine.cuda_graph`` is off.
    """
    if not engine.cuda_graph:
        return chain, None
    names = [name for name, _ in chain]
    if CUDA not in names:
        return chain, f"the provider chain {names} has no CUDA provider (in this onnxruntime build)"
    if "TensorrtExecutionProvider" in names:
        return chain, ("TensorRT is ahead of CUDA in the chain, and ONNX Runtime captures a graph only when the CUDA "
                       "provider runs every compute node: set engine.providers to [CUDAExecutionProvider, "
                       "CPUExecutionProvider] to use it")
    if not kv.in_place:
        return chain, ("decode steps have fixed shapes only on the in-place KV cache, and this model keeps the "
                       f"Concat one ({kv.reason})")
    return [(name, {**options, OPTION: "1"} if name == CUDA else options) for name, options in chain], None


def capture_active(steps: Sequence[ProviderStep]) -> bool:
    """True when the session's CUDA provider is active with graph capture on (the options it applied)."""
    return any(s.provider == CUDA and s.active and (s.applied or {}).get(OPTION) == "1" for s in steps)


def refusal(steps: Sequence[ProviderStep]) -> str:
    """Why a session asked for graphs has none: the CUDA step's recorded reason."""
    for s in steps:
        if s.provider == CUDA and not s.active:
            return s.reason or "the CUDA provider is not active"
    return "the CUDA provider did not apply enable_cuda_graph"


def open_capturing(open_chain: Callable[[Chain], tuple[Any, list[ProviderStep]]], graph_chain: Chain,
                   plain_chain: Chain) -> tuple[Any, list[ProviderStep], str | None]:
    """A session from ``graph_chain`` when it captures graphs; else from ``plain_chain`` (the first one's
    profiling ended, so it writes nothing later).

    ``open_chain`` opens a session on a chain (:func:`workers.ort_session.open_session`, bound to the graph and
    options); ``graph_chain`` is ``plain_chain`` itself when no graphs were asked for. Returns (session, the
    steps of its chain, why the session has no graphs though they were asked for, or None).
    """
    session, steps = open_chain(graph_chain)
    if graph_chain is plain_chain or capture_active(steps):
        return session, steps, None
    why = f"the CUDA provider did not open with graph capture: {refusal(steps)}"
    with contextlib.suppress(Exception):
        session.end_profiling()
    session, steps = open_chain(plain_chain)
    return session, steps, why


def run_options(graph_id: int) -> ort.RunOptions:
    """Run options that capture (first runs) or replay graph ``graph_id``; :data:`NO_GRAPH` runs without one."""
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options
