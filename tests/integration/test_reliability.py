"""Horizontal scaling and at-least-once delivery with real worker processes."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import redis

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


def test_sigkilled_worker_loses_no_request(fleet: Fleet) -> None:
    # Worker A holds every request in a 10 s window (the longest allowed), and dies inside it.
    holding = fleet.config(visibility_timeout_s=3, worker={"heartbeat_s": 0.2},
                           models={"demo-lm": {"batching": {"max_wait_ms": 10_000, "close_when_idle": False}}})
    normal = fleet.config(visibility_timeout_s=3, worker={"heartbeat_s": 0.2})
    a = fleet.worker(holding)
    client = fleet.client(normal)
    ids = [client.submit("demo-lm", [5 + i] * (3 + i)) for i in range(5)]
    r = redis.Redis.from_url(fleet.redis_url)
    deadline = time.monotonic() + 30
    while _in_flight(r, a.hostname) < 5:
        assert time.monotonic() < deadline, "worker A never took the 5 requests"
        time.sleep(0.05)
    assert all(client.status(i).value in ("queued", "running") for i in ids)
    a.kill()
    b = fleet.worker(normal)
    results = client.wait(ids, 90)
    assert all(isinstance(res, InferenceResult) for res in results), results
    assert {res.timings.worker for res in results if isinstance(res, InferenceResult)} == {b.hostname}
    assert sorted(res.request_id for res in results if isinstance(res, InferenceResult)) == sorted(ids)
