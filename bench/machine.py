"""Facts about the machine and the software a bench run measured (for the report's header)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import onnxruntime as ort
import psutil

from tools.redis_server import find_redis_server

__all__ = ["BENCH_PROVIDERS", "gpu_present", "machine_facts", "provider_chain_for", "provider_unavailable",
           "tensorrt_available"]

BENCH_PROVIDERS: dict[str, tuple[str, ...]] = {
    "cpu": ("CPUExecutionProvider",),
    "cuda": ("CUDAExecutionProvider", "CPUExecutionProvider"),
    "tensorrt": ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
}
"""``fleet bench --provider`` choice → the execution-provider chain of every phase (limit, workers, generation)."""

_EP_LABELS = {"CUDAExecutionProvider": "CUDA", "TensorrtExecutionProvider": "TensorRT"}

_PACKAGES = ("onnxruntime", "onnx", "celery", "kombu", "redis", "numpy", "pydantic")


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gpu_present() -> bool:
    """True when an NVIDIA GPU is visible (``nvidia-smi -L`` lists one)."""
    smi = shutil.which("nvidia-smi")
    return bool(smi) and "GPU" in _run([str(smi), "-L"])


def provider_chain_for(provider: str) -> tuple[str, ...]:
    """The provider chain of ``--provider`` (cpu, cuda, tensorrt).

    Raises:
        ValueError: not one of :data:`BENCH_PROVIDERS` (the message names the choices).
    """
    try:
        return BENCH_PROVIDERS[provider]
    except KeyError:
        raise ValueError(f"provider {provider!r} is not one of {sorted(BENCH_PROVIDERS)}") from None


def _tiny_model() -> bytes:
    """A one-node float graph (``y = x + x``), enough for an execution provider to be created."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9  # readable by every onnxruntime the fleet supports
    onnx.checker.check_model(model)
    data: bytes = model.SerializeToString()
    return data


def provider_unavailable(provider: str) -> str | None:
    """Why ``provider`` (cpu, cuda, tensorrt) cannot run on this machine, or None when it can.

    Each GPU execution provider of the chain must be in the imported onnxruntime build and must come
    up in a real session over a one-node graph. When it does not, the reason names the first missing
    piece: its shared libraries (TensorRT's need libnvinfer, CUDA's the CUDA user-space libraries; the
    dynamic loader's message is quoted), then an NVIDIA GPU (``nvidia-smi -L``), else ONNX Runtime's error.
    """
    from workers.ort_session import imported_ort_build, open_session, provider_library_error

    for name in provider_chain_for(provider)[:-1]:  # every GPU EP the chain needs (CPU is always there)
        label = _EP_LABELS[name]
        if name not in ort.get_available_providers():
            return f"{name} is not in this onnxruntime build ({imported_ort_build()})"
        _session, steps = open_session(_tiny_model(), ort.SessionOptions, [(name, {})])
        if steps[0].active:
            continue
        loader = provider_library_error(name)
        if loader is not None:
            return f"{label} libraries not found ({loader})"
        if not gpu_present():
            return "no CUDA device (nvidia-smi lists no GPU)"
        return f"the {label} execution provider did not start: {steps[0].reason}"
    return None


def tensorrt_available() -> bool:
    """True when the TensorRT chain can run here (see :func:`provider_unavailable`)."""
    return provider_unavailable("tensorrt") is None


def machine_facts() -> dict[str, Any]:
    """CPU, cores, memory, OS, load average and package versions, as one JSON-friendly dict."""
    try:
        redis_version = _run([find_redis_server(), "--version"]).split(" v=")[-1].split()[0]
    except FileNotFoundError:
        redis_version = "not found"
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "packages": {p: _version(p) for p in _PACKAGES},
        "ort_providers": ort.get_available_providers(),
        "gpu": gpu_present(),
        "providers_unavailable": {p: provider_unavailable(p) for p in BENCH_PROVIDERS if p != "cpu"},
        "redis_server": redis_version,
        "git_commit": _run(["git", "rev-parse", "--short", "HEAD"]),
        "git_dirty": _run(["git", "status", "--porcelain"]) not in ("", "unknown"),
        "load_average_start": [round(x, 2) for x in load],
    }
