"""The real onnxruntime-gpu wheel, in its own virtual environment, on this GPU-less machine.

onnxruntime-gpu offers TensorRT and CUDA but cannot load them here; the worker must say so
(requested vs ACTIVE providers plus a FALLBACK warning) and ``require_provider`` must refuse to
start. The environment is built once under ``var/ort-gpu-venv`` (about a minute, 256 MB wheel).
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.integration.fleet_fixtures import Fleet
from tests.tier_venv import pip_install_or_skip

pytestmark = pytest.mark.gpu_wheel

ROOT = Path(__file__).resolve().parents[2]
ORT_GPU = "onnxruntime-gpu==1.31.1"
VENV = ROOT / "var" / "ort-gpu-venv"


@pytest.fixture(scope="module")
def gpu_python() -> str:
    python = VENV / "bin" / "python"
    marker = VENV / f".ready-{ORT_GPU}-FLEET_ORT-gpu"
    if not marker.exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
        # the documented GPU install: FLEET_ORT=gpu makes setup.py depend on onnxruntime-gpu instead
        pip_install_or_skip(python, ["-e", f"{ROOT}[gpu]", ORT_GPU], env={**os.environ, "FLEET_ORT": "gpu"})
        marker.touch()
    probe = subprocess.run(
        [str(python), "-c", "import onnxruntime as o, importlib.metadata as m; "
         "print(m.version('onnxruntime-gpu'), o.get_available_providers())"],
        capture_output=True, text=True, check=True, timeout=120)
    assert "CUDAExecutionProvider" in probe.stdout and "TensorrtExecutionProvider" in probe.stdout
    # exactly one ONNX Runtime build in that environment
    dists = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                           text=True, check=True).stdout.lower()
    assert "onnxruntime-gpu==" in dists and "\nonnxruntime==" not in "\n" + dists
    return str(python)


def test_gpu_wheel_falls_back_visibly(fleet: Fleet, gpu_python: str) -> None:
    cfg = fleet.config()
    worker = fleet.worker(cfg, python=gpu_python)
    log = worker.log_tail(50000)
    assert "providers requested ['TensorrtExecutionProvider', 'CUDAExecutionProvider', 'CPUExecutionProvider']" in log
    assert "ACTIVE ['CPUExecutionProvider']" in log
    assert "FALLBACK" in log
    client = fleet.client(cfg)
    result = client.result(client.submit("demo-lm", [5, 6, 7]), wait=True, timeout_s=60)
    assert result is not None and result.top_k


def test_gpu_wheel_require_cuda_refuses_to_start(fleet: Fleet, gpu_python: str) -> None:
    cfg = fleet.config(models={"demo-lm": {"engine": {"require_provider": "CUDAExecutionProvider"}}})
    worker = fleet.worker(cfg, python=gpu_python, wait=False)
    assert worker.proc is not None
    assert worker.proc.wait(300) != 0
    assert "require_provider=CUDAExecutionProvider" in worker.log_tail(50000)


def test_this_environment_has_only_the_cpu_build() -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                         text=True, check=True).stdout.lower()
    assert "onnxruntime==" in out and "onnxruntime-gpu" not in out
