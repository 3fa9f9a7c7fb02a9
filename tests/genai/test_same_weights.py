"""The same weights give the same tokens in the fleet, a bare loop and onnxruntime-genai's og.Engine.

``fleet bench --quick --only same-weights`` builds a tiny Llama, writes its weights as a Hugging Face
checkpoint, exports it with onnxruntime-genai's model builder (in the ``genai`` tier's venv, built once
and reused while its pins stay the same), and serves one burst every way: a real worker behind Redis
(FleetClient, and the official OpenAI SDK through the gateway), the worker's own loop in process, the
bare numpy + ONNX Runtime loop (continuous and one at a time) and ``og.Engine``. Every request's
tokens must match the fleet's in every row: two independent exports and three independent loops agree
on what greedy decoding of these weights gives, which the fleet's speed figures rest on.

Offline, or on a machine without the CPU torch wheel, the tier skips (see ``tests/tier_venv.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.same_weights import QUICK, ROWS, TEXT_ONLY
from tests.tier_venv import TIERS, ensure_venv

pytestmark = [pytest.mark.genai, pytest.mark.timeout(900)]  # the first run builds the venv (a few minutes)


def test_fleet_bare_loops_and_og_engine_agree_on_every_token(tmp_path: Path) -> None:
    ensure_venv(TIERS["genai"])
    cmd = [sys.executable, "-m", "producer.cli", "bench", "--quick", "--only", "same-weights", "--out",
           str(tmp_path / "benchmarks.md"), "--work-dir", str(tmp_path / "work")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "same-weights.json").read_text())
    (size,) = results["sizes"]
    expected_tokens = size["workload"]["new_tokens"]
    assert size["workload"]["requests"] == QUICK.requests
    for name in ROWS:
        row = size["rows"][name]
        assert row["mismatched_requests"] == (None if name in TEXT_ONLY else 0), (name, row)
        assert row["miscounted_requests"] == 0 and row["tokens"] == expected_tokens, (name, row)  # forced lengths
        assert row["tokens_per_s"]["median"] > 0
    assert size["og"]["capabilities"]["configured_max_batch_size"] == QUICK.max_batch_size
    assert size["kv_in_place"] is True  # the worker served from the in-place cache
    assert set(size["ratios"]) == {"worker's loop, in process", "bare continuous", "bare one at a time", "og.Engine",
                                   "OpenAI SDK, streaming / fleet"}
    page = (tmp_path / "same-weights.md").read_text()
    assert "| fleet / og.Engine |" in page and "| OpenAI SDK, streaming / fleet |" in page
