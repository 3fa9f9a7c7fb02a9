"""Take ``docs/img/flower-tasks.png``: Flower's Tasks page after a real run, in headless Chromium.

``python -m tools.flower_screenshot [--out docs/img/flower-tasks.png]`` builds the demo models in a
temporary folder, starts a private redis-server, a ``demo-lm`` worker and ``fleet flower`` (basic
auth, the columns of :data:`producer.ops_cli.FLOWER_TASKS_COLUMNS`), submits a few requests (text,
token ids, a generation; for ``demo-encoder``, before its worker starts: one that expires in the
queue, one cancelled, one that runs), waits until Flower saw them finish, and screenshots ``/tasks``
and the expired request's page (``docs/img/flower-task-expired.png``) with Chromium (Debian:
``apt-get install -y chromium``). Not run in CI.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from producer.client import FleetClient
from protocol.settings import FleetSettings, load_settings
from tools.build_encoder import build_encoder
from tools.build_lm import build_causal_lm
from tools.processes import WorkerProcess, die_with_parent
from tools.redis_server import EmbeddedRedis, free_port

__all__ = ["CHROMIUM_FLAGS", "main", "screenshot"]

ROOT = Path(__file__).resolve().parents[1]
USER, PASSWORD = "ops", "screenshot-only"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
"""Flags that work in a container as root without a display."""
TASK_PAGE_HEIGHT = 1400
"""Pixels of the task page shown: down to its Exception and Traceback."""


def screenshot(url: str, out: Path, *, chromium: str, width: int, height: int, wait_ms: int) -> None:
    """Save ``url`` (credentials may ride in it: ``http://user:pw@host/``) as a PNG after ``wait_ms``
    of page time (the tasks table loads after the page)."""
    with tempfile.TemporaryDirectory(prefix="flower-shot-") as profile:
        subprocess.run(
            [
                chromium,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--virtual-time-budget={wait_ms}",
                f"--screenshot={out.resolve()}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )


def _wait(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.3)
    raise TimeoutError(f"no {what} after {timeout_s} s")


def _api(url: str, path: str) -> Any:
    return httpx.get(url + path, auth=(USER, PASSWORD), timeout=5).json()


def _all_final(tasks: dict[str, Any], ids: list[str]) -> bool:
    return all(tasks.get(rid, {}).get("state") in ("SUCCESS", "FAILURE", "REVOKED") for rid in ids)


def _config(tmp: Path, redis_url: str, flower_port: int) -> Path:
    lm, encoder = build_causal_lm(tmp / "models"), build_encoder(tmp / "models")
    doc = {
        "redis_url": redis_url,
        "models": {
            "demo-lm": {"path": str(lm), "engine": {"intra_op_threads": 1}},
            "demo-encoder": {"path": str(encoder), "engine": {"intra_op_threads": 1}},
        },
        "flower": {"host": "127.0.0.1", "port": flower_port, "basic_auth": [f"{USER}:{PASSWORD}"]},
    }
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _worker(settings: FleetSettings, config: Path, model: str, tmp: Path) -> WorkerProcess:
    return WorkerProcess(
        model=model,
        queue=settings.queue_for(model),
        redis_url=settings.redis_url,
        concurrency=8,
        hostname=f"{model}@node-1",
        env={"FLEET_CONFIG": str(config)},
        log_path=tmp / f"{model}.log",
        cwd=ROOT,
    ).start()


def _submit(client: FleetClient, start_encoder: Callable[[], None]) -> list[str]:
    """The requests shown; returns their IDs once each has finished."""
    ids = [
        client.submit("demo-lm", text="Hello fleet", top_k=3, request_id="hello-1"),
        client.submit("demo-lm", [5, 6, 7], top_k=2, request_id="ids-1"),
        client.submit(
            "demo-lm", text="Once upon a time", request_id="story-1", generation={"max_new_tokens": 8, "seed": 7}
        ),
        client.submit("demo-encoder", text="too late", request_id="late-1", deadline_s=0.5),
        client.submit("demo-encoder", text="never mind", request_id="cancel-1"),
        client.submit("demo-encoder", text="queued for the encoder", request_id="enc-1"),
    ]
    client.cancel("cancel-1")
    time.sleep(1.0)  # late-1's deadline passes while no encoder worker is up (the scenario, not a sync)
    start_encoder()
    _wait(lambda: all(client.status(rid).value not in ("queued", "running") for rid in ids), 60, "the results")
    return ids


def run(out: Path, *, chromium: str, width: int, height: int, keep_running: bool) -> int:
    procs: list[subprocess.Popen[bytes]] = []
    workers: list[WorkerProcess] = []
    with tempfile.TemporaryDirectory(prefix="flower-shot-") as tmp_name, EmbeddedRedis() as server:
        tmp = Path(tmp_name)
        port = free_port()
        config = _config(tmp, server.url, port)
        settings = load_settings(config)
        url = f"http://127.0.0.1:{port}"
        try:
            workers.append(_worker(settings, config, "demo-lm", tmp))
            flower = [sys.executable, "-m", "producer.ops_cli", "flower", "--config", str(config)]
            with open(tmp / "flower.log", "ab") as log:
                procs.append(
                    subprocess.Popen(
                        [*flower, "--db", str(tmp / "flower.db")],
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=die_with_parent,
                    )
                )
            workers[0].wait_ready(60)
            _wait(lambda: workers[0].hostname in _api(url, "/api/workers?refresh=true"), 60, "worker in Flower")

            def start_encoder() -> None:
                workers.append(_worker(settings, config, "demo-encoder", tmp))
                workers[-1].wait_ready(60)

            client = FleetClient(settings)
            try:
                ids = _submit(client, start_encoder)
            finally:
                client.close()
            _wait(lambda: _all_final(_api(url, "/api/tasks"), ids), 30, "final states in Flower")
            out.parent.mkdir(parents=True, exist_ok=True)
            screenshot(
                f"http://{USER}:{PASSWORD}@127.0.0.1:{port}/tasks",
                out,
                chromium=chromium,
                width=width,
                height=height,
                wait_ms=5000,
            )
            print(f"wrote {out} ({out.stat().st_size} bytes) of {url}/tasks")
            task_out = out.with_name("flower-task-expired.png")
            screenshot(
                f"http://{USER}:{PASSWORD}@127.0.0.1:{port}/task/late-1",
                task_out,
                chromium=chromium,
                width=width,
                height=TASK_PAGE_HEIGHT,
                wait_ms=2000,
            )
            print(f"wrote {task_out} ({task_out.stat().st_size} bytes) of {url}/task/late-1")
            if keep_running:
                print(f"Flower at {url} (user {USER}, password {PASSWORD}); Ctrl-C ends")
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(15)
            for worker in workers:
                worker.stop(15)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.flower_screenshot", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "flower-tasks.png")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--keep-running", action="store_true", help="leave the fleet up for a look, until Ctrl-C")
    args = parser.parse_args(argv)
    return run(args.out, chromium=args.chromium, width=args.width, height=args.height, keep_running=args.keep_running)


if __name__ == "__main__":
    raise SystemExit(main())
