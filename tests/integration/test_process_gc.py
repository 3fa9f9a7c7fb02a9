"""A worker and a gateway freeze their start-up objects out of the garbage collector once they are up
(``protocol.process_gc``): a full collection over them stopped every thread of a worker for 55 to 62 ms
in the middle of a burst. Real ``celery worker`` and ``fleet api`` processes; their logs say how many
objects were frozen."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx

from tests.integration.fleet_fixtures import Fleet
from tools.processes import poll_until, stop_process
from tools.redis_server import free_port

FROZEN = re.compile(r"(worker|gateway): (\d+) start-up objects frozen out of the garbage collector")


def _frozen(text: str, what: str) -> int:
    counts = [int(n) for who, n in FROZEN.findall(text) if who == what]
    assert len(counts) == 1, f"{what} froze {len(counts)} times: {text[-2000:]}"
    return counts[0]


def test_a_worker_and_a_gateway_freeze_their_start_up_objects_once_up(fleet: Fleet) -> None:
    cfg = fleet.config()
    worker = fleet.worker(cfg)  # returns once ready: the freeze happens as it announces it
    assert worker.log_path is not None
    assert _frozen(worker.log_path.read_text(), "worker") > 10_000  # Celery, kombu, pydantic, the model's loader

    port = free_port()
    log_path = fleet.tmp_path / "gateway.log"
    json_logs = fleet.config(log={"format": "json"})  # the fleet's own info lines reach the gateway's log
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "api", "--config", str(json_logs), "--host",
                                 "127.0.0.1", "--port", str(port), "--log-level", "info"],
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            def up() -> bool:
                assert proc.poll() is None, log_path.read_text()[-2000:]
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            poll_until(up, 60, "the gateway to answer /healthz")
            assert _frozen(log_path.read_text(), "gateway") > 10_000
        finally:
            stop_process(proc, 10)
