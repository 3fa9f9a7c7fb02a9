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


def test_demo_versions_publishes_pins_splits_and_rolls_back_on_the_embedded_store() -> None:
    """`fleet demo --versions`: the run command publishes demo-lm twice to an embedded SeaweedFS, pins,
    splits 50 % to a canary, rolls back; every step's results name the version(s) then in force."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "AWS_"))}
    proc = subprocess.run([sys.executable, "-m", "producer.cli", "demo", "--requests", "16", "--no-flower",
                           "--versions"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = dict(line.removeprefix("versions: ").split(": ", 1) for line in proc.stdout.splitlines()
                 if line.startswith("versions: ") and not line.startswith("versions: history"))
    assert steps["pin 1.1.0"] == "1.1.0/stable 20", steps
    split = dict(part.rsplit(" ", 1) for part in steps["canary 1.0.0 at 50 %"].split(", "))
    assert set(split) == {"1.0.0/canary", "1.1.0/stable"}, split
    assert 8 <= int(split["1.0.0/canary"]) <= 32, split  # 40 keys hashed at 50 %
    assert steps["rollback (canary dropped)"] == "1.1.0/stable 20", steps
    assert "pin 1.1.0 → canary 1.1.0 + canary 1.0.0 → rollback 1.1.0 → rollback configured" in proc.stdout
    assert "published demo-lm 1.1.0 to s3://fleet-models" in proc.stderr
