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

__all__ = ["Placement", "count_placement", "profiled_placement"]


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
        path = session.end_profiling()
        with open(path, encoding="utf-8") as fh:
            events = json.load(fh)
    return Placement(count_placement(events), list(session.get_providers()), steps)
