"""The README's run command, end to end: `fleet demo` (what `make demo` runs after installing)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_end_to_end_and_shuts_down() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}  # the embedded default
    proc = subprocess.run([sys.executable, "-m", "producer.cli", "demo", "--requests", "24"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    results = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(results) >= 4
    assert {r["model"] for r in results} == {"demo-lm", "demo-encoder"}
    summary = next(line for line in lines if line.startswith("throughput:"))
    match = re.search(r"(\d+) requests ok, 0 failed", summary)
    assert match and int(match.group(1)) == 24 + 4, summary
    assert re.search(r"mean batch size \d+\.\d+", summary)
    assert "flower: " in proc.stdout and "tasks visible" in proc.stdout
    assert "private redis-server" in proc.stderr
