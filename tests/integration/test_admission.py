"""Admission control against real Redis, real gateways and real workers.

Queue cap → 429 + Retry-After (and QueueFull from the client); a token bucket shared by two
gateway processes; a deadline that passes in the queue → expired, never computed.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from producer.admission import Admission, bucket_take, rate_key_for
from producer.client import FleetClient
from protocol.errors import QueueFull, ResultTimeout
from protocol.keys import RATE_KEY
from protocol.settings import load_settings
from tests.integration.ops_fixtures import API_KEY, OpsFleet, ops_fleet, ops_models, ops_redis, scrape, wait_until
from tools.redis_server import free_port

__all__ = ["ops_fleet", "ops_models", "ops_redis"]

AUTH = {"X-API-Key": API_KEY}
MAX_RETRY_AFTER_S = 17


def _status(http: httpx.Client, rid: str) -> str:
    status: str = http.get(f"/v1/requests/{rid}").json()["status"]
    return status


def _all_finished(http: httpx.Client, ids: list[str], timeout_s: float = 60) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []

    def done() -> bool:
        docs[:] = [http.get(f"/v1/requests/{rid}").json() for rid in ids]
        return all(d["status"] not in ("queued", "running") for d in docs)

    wait_until(done, timeout_s, f"{len(ids)} requests to finish")
    return docs


def test_queue_cap_refuses_with_retry_after_and_accepted_requests_complete(ops_fleet: OpsFleet) -> None:
    config = ops_fleet.config(
        models={"demo-lm": {"max_queue_depth": 4}}, admission={"max_retry_after_s": MAX_RETRY_AFTER_S}
    )
    gateway = ops_fleet.gateway(config)
    http = httpx.Client(base_url=gateway.url, headers=AUTH, timeout=10)
    accepted = []
    for i in range(4):
        resp = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [3, 4, i + 5]})
        assert resp.status_code == 202, resp.text
        accepted.append(resp.json()["request_id"])

    refused = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [1]})
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == str(MAX_RETRY_AFTER_S)  # no worker drains: the cap
    body = refused.json()
    assert body["type"] == "QueueFull" and "max_queue_depth=4" in body["message"] and body["limit"] == 4
    batch = http.post("/v1/requests:batch", json={"requests": [{"model": "demo-lm", "input_ids": [1]}]})
    assert batch.status_code == 429 and batch.json()["type"] == "QueueFull"

    client = FleetClient(load_settings(config))
    try:
        with pytest.raises(QueueFull) as info:
            client.submit("demo-lm", [1, 2])
        assert info.value.retry_after_s == MAX_RETRY_AFTER_S and info.value.limit == 4
        # a request ID already accepted is not refused: resubmitting the same request is a no-op
        assert client.submit("demo-lm", [3, 4, 5], request_id=accepted[0]) == accepted[0]
        # waiting on a queued request times out cleanly and leaves no result subscription behind
        with pytest.raises(ResultTimeout) as timed_out:
            client.result(accepted[0], wait=True, timeout_s=0.2)
        assert timed_out.value.field == "timeout_s" and timed_out.value.limit == 0.2
        assert not client.app.backend.result_consumer.subscribed_to
    finally:
        client.close()
    assert [_status(http, rid) for rid in accepted] == ["queued"] * 4

    worker = ops_fleet.worker(config)
    docs = _all_finished(http, accepted)
    assert [d["status"] for d in docs] == ["succeeded"] * 4
    assert [d["result"]["input_tokens"] for d in docs] == [3] * 4

    # the worker's drain meter now feeds Retry-After: fill the queue again with the worker stopped
    worker.stop()
    assert Admission(ops_fleet.redis, load_settings(config)).drain_rate_per_s("demo-lm") > 0
    for i in range(4):
        assert http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [i + 1]}).status_code == 202
    measured = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [1]})
    assert measured.status_code == 429
    assert 1 <= int(measured.headers["Retry-After"]) < MAX_RETRY_AFTER_S
    http.close()


def test_two_gateways_share_one_token_bucket(ops_fleet: OpsFleet) -> None:
    capacity, refill_per_s = 10, 2.0
    config = ops_fleet.config(admission={"rate_capacity": capacity, "rate_refill_per_s": refill_per_s})
    gateways = ops_fleet.gateway_replicas(config, 2)
    clients = [httpx.Client(base_url=g.url, headers=AUTH, timeout=10) for g in gateways]
    body = {"model": "demo-lm", "input_ids": [1, 2]}
    bucket = RATE_KEY.format(key=rate_key_for(API_KEY))

    # more inputs at once than the bucket holds: refused before it is touched, named as the body names them
    too_many = clients[0].post("/v1/embeddings", json={"model": "demo-encoder", "input": [[5, 6]] * (capacity + 1)})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "input", too_many.text
    # one request alone first, so the bucket's timestamp is exactly the first admission's time
    assert clients[0].post("/v1/requests", json=body).status_code == 202
    first_ts = float(ops_fleet.redis.hget(bucket, "ts") or 0)
    counts: list[Counter[int]] = [Counter(), Counter()]
    retry_after: list[str] = []
    give_up_at = time.monotonic() + 60  # a bound for a broken bucket, not a window the test relies on

    def driven_past_the_bucket(i: int) -> bool:
        return counts[i][202] > 0 and counts[i][429] > 0

    def drive(i: int) -> None:  # until this gateway has both admitted and refused (an event, not a time)
        while not driven_past_the_bucket(i) and time.monotonic() < give_up_at:
            resp = clients[i].post("/v1/requests", json=body)
            counts[i][resp.status_code] += 1
            if resp.status_code == 429:
                retry_after.append(resp.headers["Retry-After"])

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()

    last_ts = float(ops_fleet.redis.hget(bucket, "ts") or 0)
    left = float(ops_fleet.redis.hget(bucket, "tokens") or 0)
    admitted = 1 + counts[0][202] + counts[1][202]
    expected = capacity + refill_per_s * (last_ts - first_ts)
    print(f"two gateways, bucket {capacity} + {refill_per_s}/s: admitted {admitted}, capacity + refill over "
          f"{last_ts - first_ts:.2f} s = {expected:.2f}, 429s {counts[0][429]} + {counts[1][429]}")  # fmt: skip
    assert all(set(c) <= {202, 429} for c in counts), counts
    assert counts[0][429] > 0 and counts[1][429] > 0, counts  # both gateways were driven past the bucket
    assert counts[0][202] > 0 and counts[1][202] > 0, counts
    assert abs(admitted - expected) < 1, (admitted, expected, counts)
    assert admitted + left == pytest.approx(expected, abs=1e-5)  # exact accounting, Redis clock
    assert set(retry_after) <= {"1"}  # one token comes back within 0.5 s at 2/s


def test_lua_bucket_matches_the_pure_model(ops_fleet: OpsFleet) -> None:
    config = ops_fleet.config(admission={"rate_capacity": 5, "rate_refill_per_s": 1.5})
    admission = Admission(ops_fleet.redis, load_settings(config))
    rng = random.Random(7)
    tokens = ts = None
    now = 1_000_000.0
    for _ in range(200):
        now += rng.choice([0.0, 0.05, 0.3, 1.0, 4.0, -0.5])  # includes a clock that steps back
        cost = rng.choice([1, 1, 1, 2, 5])
        model = bucket_take(tokens, ts, now, capacity=5, refill_per_s=1.5, cost=cost)
        allowed, left = admission.take_tokens("pure-vs-lua", cost, now_s=now)
        assert allowed == model.allowed
        assert left == pytest.approx(model.tokens, abs=1e-6)
        tokens, ts = model.tokens, model.ts_s


def test_deadline_passed_in_queue_is_expired_and_never_computed(ops_fleet: OpsFleet) -> None:
    config = ops_fleet.config()
    gateway = ops_fleet.gateway(config)
    http = httpx.Client(base_url=gateway.url, headers=AUTH, timeout=10)
    doomed = [9] * 7
    resp = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": doomed, "deadline_s": 0.3})
    assert resp.status_code == 202
    expiring = resp.json()["request_id"]
    kept = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [4, 5, 6]}).json()["request_id"]
    deadline = time.time() + 0.3
    wait_until(lambda: time.time() > deadline + 0.05, 5, "the deadline to pass while no worker runs")
    assert _status(http, expiring) == "queued"

    port = free_port()
    worker = ops_fleet.worker(config, metrics_port=port)
    docs = {d["request_id"]: d for d in _all_finished(http, [expiring, kept])}
    assert docs[expiring]["status"] == "expired" and docs[expiring]["result"] is None
    assert docs[expiring]["error"]["type"] == "RequestExpired"
    assert docs[kept]["status"] == "succeeded"

    m = (("model", "demo-lm"),)

    def counted() -> dict[Any, float] | None:
        w = scrape(f"http://127.0.0.1:{port}/metrics")
        done = w[("fleet_worker_requests_total", (("model", "demo-lm"), ("outcome", "succeeded")))]
        return w if done == 1 else None

    w = wait_until(counted, 10, "the worker's metrics")
    assert w[("fleet_worker_requests_total", (("model", "demo-lm"), ("outcome", "expired")))] == 1
    # the engine saw one batch with the kept request's 3 tokens: the doomed 7 tokens never ran
    assert w[("fleet_worker_batch_size_count", m)] == 1
    assert w[("fleet_worker_tokens_total", (("kind", "real"), ("model", "demo-lm")))] == 3
    heartbeat = wait_until(lambda: worker.wait_ready(5).get("batches_run") == 1, 10, "batches_run in heartbeat")
    assert heartbeat
    http.close()


def test_the_cap_counts_the_canary_queue_too(redis_server: Any) -> None:
    """Every worker of a model takes from its stable and its canary queue; requests waiting in either
    count against ``max_queue_depth`` (a 10 % canary split used to let the canary queue grow unbounded)."""
    import redis as redis_lib

    settings = load_settings(None, models={"m": {"path": "/nonexistent.onnx", "max_queue_depth": 5}},
                             admission={"queue_depth_cache_ms": 0})
    r = redis_lib.Redis.from_url(redis_server.url)
    stable, canary = settings.queue_for("m"), settings.canary_queue_for("m")
    try:
        r.lpush(stable, *[b"waiting"] * 3)
        admission = Admission(r, settings)
        admission.check_queue("m", 2)  # 3 + 2 = the cap: admitted
        r.lpush(canary, *[b"waiting"] * 2)
        with pytest.raises(QueueFull) as full:
            admission.check_queue("m", 1)
        assert full.value.field == "max_queue_depth" and full.value.limit == 5
        assert "holds 5" in str(full.value) or "hold 5" in str(full.value), full.value
    finally:
        r.delete(stable, canary)
