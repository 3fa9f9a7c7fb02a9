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

__all__ = ["gpu_present", "machine_facts", "tensorrt_available"]

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


def tensorrt_available() -> bool:
    """True when this onnxruntime build has the TensorRT EP and a GPU is present."""
    return "TensorrtExecutionProvider" in ort.get_available_providers() and gpu_present()


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
        "redis_server": redis_version,
        "git_commit": _run(["git", "rev-parse", "--short", "HEAD"]),
        "git_dirty": _run(["git", "status", "--porcelain"]) not in ("", "unknown"),
        "load_average_start": [round(x, 2) for x in load],
    }
