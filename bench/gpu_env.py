"""``fleet gpu-report``'s environment: the GPU ``nvidia-smi`` sees, the providers that load, the software.

Sections 1 and 2 of :mod:`bench.gpu_report`. onnxruntime is imported inside the functions, not at the top:
``fleet <any command>`` imports :mod:`bench.gpu_report` (and so this module) to register it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from typing import Any

__all__ = ["CHOICE_FOR", "COMMIT_ENV", "PROVIDERS", "best_choice", "environment", "gpu_facts", "provider_rows"]

COMMIT_ENV = "FLEET_GIT_COMMIT"
"""The commit to state when the tree is a copy without ``.git`` (e.g. shipped to a GPU machine)."""

PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
"""Every execution provider the report probes, best first."""

CHOICE_FOR = {"TensorrtExecutionProvider": "tensorrt", "CUDAExecutionProvider": "cuda", "CPUExecutionProvider": "cpu"}
"""Provider → ``--provider`` choice whose chain starts with it (:data:`bench.machine.BENCH_PROVIDERS`)."""


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()


def gpu_facts() -> dict[str, Any]:
    """The GPUs ``nvidia-smi`` sees (model, memory, driver) and the CUDA version the driver supports.

    ``{"gpus": [], "reason": ...}`` without ``nvidia-smi`` or without a GPU.
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"gpus": [], "reason": "nvidia-smi not found (no NVIDIA driver on this machine)"}
    rows = _run([smi, "--query-gpu=name,memory.total,driver_version,compute_cap", "--format=csv,noheader"])
    gpus = []
    for line in rows.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            gpus.append({"name": parts[0], "memory": parts[1], "driver": parts[2],
                         "compute_capability": parts[3] if len(parts) > 3 else "unknown"})  # fmt: skip
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", _run([smi]))
    out: dict[str, Any] = {"gpus": gpus, "driver_cuda": cuda.group(1) if cuda else "unknown"}
    if not gpus:
        out["reason"] = "nvidia-smi lists no GPU"
    return out


def provider_rows() -> list[dict[str, Any]]:
    """One row per provider of :data:`PROVIDERS`: in the imported build, loads, and why not.

    "Loads" means a real session over a one-node graph came up with that provider active
    (:func:`bench.machine.provider_unavailable`); the reason quotes the first missing piece.
    """
    import onnxruntime as ort

    from bench.machine import provider_unavailable

    available = ort.get_available_providers()
    rows = []
    for name in PROVIDERS:
        reason = None if name == "CPUExecutionProvider" else provider_unavailable(CHOICE_FOR[name])
        rows.append({"provider": name, "in_build": name in available, "loads": reason is None, "reason": reason})
    return rows


def best_choice(rows: list[dict[str, Any]]) -> str:
    """The best ``--provider`` choice that loads (tensorrt, then cuda, then cpu)."""
    return next(CHOICE_FOR[r["provider"]] for r in rows if r["loads"])


def environment() -> dict[str, Any]:
    """The machine, the GPU and the software of the run."""
    from bench.machine import machine_facts
    from workers.ort_session import imported_ort_build, preload_gpu_libraries

    facts = machine_facts()
    commit = facts["git_commit"] if facts["git_commit"] != "unknown" else os.environ.get(COMMIT_ENV, "unknown")
    return {
        "gpu": gpu_facts(),
        "onnxruntime": imported_ort_build(),
        "cuda_libraries": preload_gpu_libraries() if "CUDAExecutionProvider" in _available_providers()
        else "not needed: this onnxruntime build has no CUDA provider",
        "cpu": facts["cpu"], "logical_cores": facts["logical_cores"], "memory_gib": facts["memory_gib"],
        "os": facts["os"], "python": facts["python"], "packages": facts["packages"],
        "git_commit": commit,
        "git_dirty": facts["git_dirty"],
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip


def _available_providers() -> list[str]:
    import onnxruntime as ort  # here, not at the top: `fleet <any command>` imports this module to register it

    return list(ort.get_available_providers())
