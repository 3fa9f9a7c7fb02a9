"""The optimum tier's session fixtures: its virtual environment and the exports built inside it.

``optimum_python`` builds ``var/optimum-venv`` (torch CPU, transformers, optimum) on first use and
reuses it while its pins (``tests.tier_venv.TIERS``) stay the same; ``exports`` runs ``export_models.py``
there once per session (a tiny random GPT-2 and Llama, exported to ONNX ``text-generation-with-past``,
with transformers' greedy references). Offline, or without the CPU torch wheel, the tier skips (``tests/tier_venv.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.tier_venv import TIERS, ensure_venv

ROOT = Path(__file__).resolve().parents[2]
TIER = TIERS["optimum"]
EXPORT_SCRIPT = Path(__file__).with_name("export_models.py")


@pytest.fixture(scope="session")
def optimum_python() -> str:
    """The tier's venv (built on first use, reused while its pins stay the same: ``tests.tier_venv``)."""
    return str(ensure_venv(TIER))


@pytest.fixture(scope="session")
def exports(optimum_python: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The two exports and transformers' references (``export_models.py``'s references.json)."""
    out = tmp_path_factory.mktemp("optimum-exports")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([optimum_python, str(EXPORT_SCRIPT), str(out)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, f"{EXPORT_SCRIPT.name} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    return out, json.loads((out / "references.json").read_text())
