"""Horizontal scaling and at-least-once delivery with real worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from producer.client import FleetClient
from protocol.keys import WORKER_KEY_PREFIX
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet


def test_two_workers_on_one_queue_both_serve(fleet: Fleet) -> None:
    cfg = fleet.config()
    w1 = fleet.worker(cfg)
    w2 = fleet.worker(cfg)
    client = fleet.client(cfg)
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda i: client.submit("demo-lm", [3 + i % 100] * (4 + i % 30)), range(96)))
    results = client.wait(ids, 120)
    assert all(isinstance(r, InferenceResult) for r in results)
    served_by = {r.timings.worker for r in results if isinstance(r, InferenceResult)}
    assert served_by == {w1.hostname, w2.hostname}


def _in_flight(r: redis.Redis, hostname: str) -> int:
    raw = r.get(WORKER_KEY_PREFIX + hostname)
    return int(json.loads(raw)["in_flight"]) if raw else -1


def _worker_killed_holding(fleet: Fleet, sizes: list[int]) -> tuple[Path, FleetClient, list[str]]:
    """Worker A takes one request of each size in ``sizes`` inside a 10 s batching window (the longest
    allowed) and is SIGKILLed there. Returns the plain config (``visibility_timeout_s: 3``), a client and the IDs."""
    holding = fleet.config(visibility_timeout_s=3, worker={"heartbeat_s": 0.2},
                           models={"demo-lm": {"batching": {"max_wait_ms": 10_000, "close_when_idle": False}}})
    normal = fleet.config(visibility_timeout_s=3, worker={"heartbeat_s": 0.2})
    a = fleet.worker(holding)
    client = fleet.client(normal)
    ids = [client.submit("demo-lm", [5 + i] * size) for i, size in enumerate(sizes)]
    r = redis.Redis.from_url(fleet.redis_url)
    deadline = time.monotonic() + 30
    while _in_flight(r, a.hostname) < len(ids):
        assert time.monotonic() < deadline, f"worker A never took the {len(ids)} requests"
        time.sleep(0.05)
    assert all(client.status(i).value in ("queued", "running") for i in ids)
    a.kill()
    return normal, client, ids


def test_sigkilled_worker_loses_no_request(fleet: Fleet) -> None:
    normal, client, ids = _worker_killed_holding(fleet, [3, 4, 5, 6, 7])
    b = fleet.worker(normal)
    results = client.wait(ids, 90)
    assert all(isinstance(res, InferenceResult) for res in results), results
    assert {res.timings.worker for res in results if isinstance(res, InferenceResult)} == {b.hostname}
    assert sorted(res.request_id for res in results if isinstance(res, InferenceResult)) == sorted(ids)


def test_restores_resume_soon_after_a_process_dies_holding_the_restore_lock(fleet: Fleet) -> None:
    # kombu scans for messages past their visibility timeout under a Redis lock. A worker SIGKILLed inside
    # a scan leaves the lock held for its whole life (kombu's default: 300 s), and no worker restores
    # anything until then: here a dead worker's requests would wait that long for worker B.
    normal, client, ids = _worker_killed_holding(fleet, [3, 2])
    holder = subprocess.run([sys.executable, "-m", "tests.integration.restore_lock_holder"],
                            env={**os.environ, "FLEET_CONFIG": str(normal)}, capture_output=True, text=True,
                            timeout=60, check=False)
    # it printed the lock's value from inside the lock (which lives 1 s here: it may be gone by now)
    assert holder.returncode == -signal.SIGKILL and len(holder.stdout.split()) == 2, holder
    b = fleet.worker(normal)
    # the lock expires within its life (one scan interval: at most 30 s; 1 s here), then B's next scan restores both
    results = client.wait(ids, 75)
    assert all(isinstance(res, InferenceResult) for res in results), results
    assert {res.timings.worker for res in results if isinstance(res, InferenceResult)} == {b.hostname}
