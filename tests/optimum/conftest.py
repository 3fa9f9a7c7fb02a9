"""The optimum tier's session fixtures: its virtual environment and the exports built inside it.

``optimum_python`` builds ``var/optimum-venv`` (torch CPU, transformers, optimum) on first use and
reuses it while ``PINS`` stay the same; ``exports`` runs ``export_models.py`` there once per session
(a tiny random GPT-2 and Llama, exported to ONNX ``text-generation-with-past``, with transformers'
greedy references). Offline, or without the CPU torch wheel, the tier skips (``tests/tier_venv.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import venv
from pathlib import Path
from typing import Any

import pytest

from tests.tier_venv import pip_install_or_skip

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / "var" / "optimum-venv"
TORCH_CPU = "torch==2.13.0+cpu"
"""The CPU wheel on this machine's disk (pip's find-links); any other torch would download CUDA."""
PINS = (TORCH_CPU, "transformers==4.57.6", "optimum==2.1.0", "optimum-onnx==0.1.0", "onnx==1.23.2",
        "onnxruntime==1.31.1")
"""optimum-onnx 0.1.0 needs optimum ~=2.1.0 and transformers <4.58."""
EXPORT_SCRIPT = Path(__file__).with_name("export_models.py")


@pytest.fixture(scope="session")
def optimum_python() -> str:
    """The tier's venv (built on first use, reused while ``PINS`` stay the same)."""
    python = VENV / "bin" / "python"
    marker = VENV / f".ready-{hashlib.sha256(' '.join(PINS).encode()).hexdigest()[:16]}"
    if not marker.exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
        pip_install_or_skip(python, PINS, local_only=[TORCH_CPU], timeout_s=600)
        marker.touch()
    return str(python)


@pytest.fixture(scope="session")
def exports(optimum_python: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The two exports and transformers' references (``export_models.py``'s references.json)."""
    out = tmp_path_factory.mktemp("optimum-exports")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([optimum_python, str(EXPORT_SCRIPT), str(out)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, f"{EXPORT_SCRIPT.name} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    return out, json.loads((out / "references.json").read_text())
