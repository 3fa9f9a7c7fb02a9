"""The gateway's /docs renders its operations in a real headless Chromium with no network at all.

The gateway and the browser run together in a fresh network namespace (``unshare --net``: only a
loopback interface, no route anywhere), so any asset fetched from a CDN would fail to load and
Swagger UI would render nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is missing"),
]


def _render_in_private_netns(tmp_path: Path, page: str) -> str:
    script = textwrap.dedent(
        f"""
        set -e
        ip link set lo up
        {sys.executable} -m producer.cli api --host 127.0.0.1 --port 8765 --log-level warning \\
            > {tmp_path}/gateway.log 2>&1 &
        for i in $(seq 1 100); do
          {sys.executable} -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/healthz')" \\
            2>/dev/null && break
          sleep 0.1
        done
        {CHROMIUM} --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \\
          --disable-background-networking --disable-component-update --disable-sync \\
          --user-data-dir={tmp_path}/profile --virtual-time-budget=15000 --dump-dom \\
          http://127.0.0.1:8765{page} 2>{tmp_path}/chromium.log
        kill %1
        """
    )
    env = {**os.environ, "FLEET_REDIS_URL": "redis://127.0.0.1:1/0", "FLEET_CONFIG": str(ROOT / "configs/fleet.yaml")}
    proc = subprocess.run(["unshare", "--net", "bash", "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + (tmp_path / "gateway.log").read_text()
    return proc.stdout


def test_swagger_ui_lists_the_operations_without_network(tmp_path: Path) -> None:
    dom = _render_in_private_netns(tmp_path, "/docs")
    assert "swagger-ui" in dom
    for path in ("/v1/requests", "/v1/requests/{request_id}", "/v1/chat/completions", "/v1/completions"):
        assert f'data-path="{path}"' in dom, path  # an operation block Swagger UI rendered from /openapi.json
    assert "cdn.jsdelivr.net" not in dom


def test_redoc_renders_without_network(tmp_path: Path) -> None:
    dom = _render_in_private_netns(tmp_path, "/redoc")
    assert "onnx-fleet gateway" in dom and "/v1/requests" in dom
