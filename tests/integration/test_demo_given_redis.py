"""`fleet demo` with FLEET_REDIS_URL naming a Redis that is down: one line that says why and that the demo
starts its own Redis when FLEET_REDIS_URL is unset, exit 1, and nothing built or started first."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tools.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]


def test_a_down_redis_named_by_fleet_redis_url_is_refused_with_the_unset_hint(tmp_path: Path) -> None:
    down = EmbeddedRedis().start()
    url = down.url
    down.stop()  # a Redis that was there and is down now
    (tmp_path / "configs").mkdir()
    config = shutil.copy(ROOT / "configs" / "fleet.yaml", tmp_path / "configs" / "fleet.yaml")  # models: ../models
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}, "FLEET_REDIS_URL": url}
    proc = subprocess.run([sys.executable, "-m", "producer.cli", "demo", "--no-flower", "--config", str(config)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fleet: cannot reach Redis at {url}"), proc.stderr
    assert "unset FLEET_REDIS_URL: `fleet demo` then starts its own private Redis" in lines[0]
    assert not (tmp_path / "models").exists()  # refused before building the demo models (or starting workers)
