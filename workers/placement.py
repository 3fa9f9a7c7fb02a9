"""Which execution provider ran each node of a graph: counted from one profiled ``session.run``.

ONNX Runtime decides node placement when it creates a session (each node goes to the first provider
of the chain that has a kernel for it) and reports it only as a VERBOSE log line, which a worker's
log level hides. Its profiler, though, records every node it runs with the provider that ran it
(``args.provider`` of each ``*_kernel_time`` event). So the placement of a graph is read from one
profiled run over real inputs:

    {"CUDAExecutionProvider": 212, "CPUExecutionProvider": 14}

A GPU session whose count for ``CPUExecutionProvider`` is not zero copies tensors across the bus at
each such node (dynamic INT8's ``DynamicQuantizeLinear`` on the CUDA EP is the classic case).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy.typing as npt
import onnxruntime as ort

from workers.ort_session import ProviderStep, open_session

__all__ = ["Placement", "count_placement", "format_nodes", "placement_warning", "profiled_placement", "read_placement"]

_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
CPU_SHARE_WARNING = 0.10
"""A GPU session that runs more than this fraction of its nodes on the CPU is logged at WARNING."""


@dataclass(frozen=True)
class Placement:
    """Node counts per execution provider of one session, with the chain that opened it."""

    nodes: dict[str, int]
    """Provider name → number of distinct graph nodes it ran in the profiled run."""
    active: list[str]
    """``session.get_providers()``: the providers the session was created with, in order."""
    steps: list[ProviderStep] = field(default_factory=list)
    """What became of each provider of the requested chain (:func:`workers.ort_session.open_session`)."""

    @property
    def total(self) -> int:
        """Nodes run, all providers together."""
        return sum(self.nodes.values())

    def share(self, provider: str) -> float:
        """Fraction of the nodes ``provider`` ran (0.0 when none ran)."""
        return self.nodes.get(provider, 0) / self.total if self.total else 0.0


def count_placement(events: list[dict[str, Any]]) -> dict[str, int]:
    """Distinct nodes per provider in an ONNX Runtime profile (its JSON list of trace events).

    Only ``Node`` events ending in ``_kernel_time`` carry the provider; a node run several times
    (several runs in one profile) is counted once.
    """
    seen: dict[str, str] = {}
    for event in events:
        if event.get("cat") != "Node" or not str(event.get("name", "")).endswith("_kernel_time"):
            continue
        provider = (event.get("args") or {}).get("provider")
        if provider:
            seen[str(event["name"])[: -len("_kernel_time")]] = str(provider)
    return dict(sorted(Counter(seen.values()).items(), key=lambda kv: (-kv[1], kv[0])))


def profiled_placement(
    source: str | bytes,
    make_options: Callable[[], ort.SessionOptions],
    chain: list[tuple[str, dict[str, Any]]],
    feeds: Mapping[str, npt.NDArray[Any]],
) -> Placement:
    """Open ``source`` on ``chain`` (step by step, options kept), run ``feeds`` once under the
    profiler and count the nodes each provider ran.

    The profile file goes to a temporary folder and is removed. ``make_options`` builds the session
    options the worker would use; profiling is switched on in a copy of them.
    """
    with tempfile.TemporaryDirectory(prefix="fleet-placement-") as folder:

        def options() -> ort.SessionOptions:
            opts = make_options()
            opts.enable_profiling = True
            opts.profile_file_prefix = os.path.join(folder, "placement")
            return opts

        session, steps = open_session(source, options, chain)
        session.run(None, dict(feeds))
        nodes = read_placement(session)
    return Placement(nodes, list(session.get_providers()), steps)


def read_placement(session: ort.InferenceSession) -> dict[str, int]:
    """End ``session``'s profiling (ONNX Runtime records nothing more after it) and count the nodes each
    provider ran in the profile it wrote; the profile file is removed.

    Raises:
        ValueError: the session was not profiling (``SessionOptions.enable_profiling`` was off).
    """
    path = session.end_profiling()
    if not path:
        raise ValueError("the session was not profiling: set SessionOptions.enable_profiling before creating it")
    try:
        with open(path, encoding="utf-8") as fh:
            events = json.load(fh)
    finally:
        os.remove(path)
    return count_placement(events)


def format_nodes(nodes: Mapping[str, int]) -> str:
    """``{"CUDAExecutionProvider": 190, "CPUExecutionProvider": 6}`` → ``"CUDA 190, CPU 6"``."""
    return ", ".join(f"{name.removesuffix('ExecutionProvider')} {count}" for name, count in nodes.items())


def placement_warning(nodes: Mapping[str, int], providers: list[str]) -> bool:
    """True when a session with a GPU provider active runs more than :data:`CPU_SHARE_WARNING` of its
    nodes on the CPU (each such node copies its tensors across the bus at every run)."""
    total = sum(nodes.values())
    on_cpu = nodes.get("CPUExecutionProvider", 0)
    return any(p in providers for p in _GPU_PROVIDERS) and total > 0 and on_cpu / total > CPU_SHARE_WARNING
