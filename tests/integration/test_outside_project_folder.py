"""Day one, from another folder: ``fleet`` reads ``configs/fleet.yaml`` where it runs, so a user who ran
``make`` and then ``cd``-ed elsewhere got "unknown model 'demo-lm'; configured models: none" from every command,
and ``fleet demo`` started its Redis before it said so. Now a command says why no model is configured (no config
file read, where it looked, FLEET_CONFIG), and ``fleet demo`` runs on the config of the install it runs from.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _fleet(cwd: Path, *args: str, redis_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    if redis_url is not None:
        env["FLEET_REDIS_URL"] = redis_url
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "producer.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_command_outside_the_project_folder_says_why_no_model_is_configured(tmp_path: Path) -> None:
    done = _fleet(tmp_path, "submit", "--model", "demo-lm", "--text", "hi",
                  redis_url="redis://127.0.0.1:1/0")  # nothing listens there: the model is checked first
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line == (f"fleet: unknown model 'demo-lm'; configured models: none (no config file was read: "
                    f"configs/fleet.yaml is not in {tmp_path}; run from the folder that holds it, or set FLEET_CONFIG "
                    "to its path)")


def test_the_demo_refuses_settings_without_its_models_before_it_starts_anything(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("models: {}\n")
    done = _fleet(tmp_path, "demo", "--no-flower", "--config", str(config))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [  # no private redis-server started first
        f"fleet: the demo needs its models: {config} configures neither demo-lm nor demo-encoder"]


def test_the_demo_runs_from_another_folder_on_the_install_config(tmp_path: Path) -> None:
    done = _fleet(tmp_path, "demo", "--no-flower")  # on its own private Redis
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines()[0] == (f"[demo] settings from {ROOT / 'configs/fleet.yaml'} "
                                           f"(configs/fleet.yaml is not in {tmp_path})")
    assert "68 requests ok, 0 failed" in done.stdout
