"""The bulk path: many requests per Celery message, one result per request ID."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from protocol.errors import InvalidRequest, QueueFull, TokenOutOfRange
from protocol.keys import DRAIN_KEY
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import scrape, wait_until
from tools.redis_server import free_port


def test_bulk_results_equal_single_requests_and_bad_ones_fail_alone(fleet: Fleet) -> None:
    port = free_port()
    cfg = fleet.config(worker={"metrics_port": port})
    fleet.worker(cfg)
    client = fleet.client(cfg)
    seqs = [[3 + (i * 7) % 500] * (1 + i % 40) for i in range(300)]
    bulk_ids = client.submit_bulk("demo-lm", seqs, chunk_size=128, top_k=3)
    assert len(set(bulk_ids)) == 300
    bulk = client.wait(bulk_ids, 120)
    assert all(isinstance(r, InferenceResult) for r in bulk)
    singles = client.wait([client.submit("demo-lm", s, top_k=3) for s in seqs[:20]], 60)
    for b, s in zip(bulk[:20], singles, strict=True):
        assert isinstance(b, InferenceResult) and isinstance(s, InferenceResult)
        assert b.top_k is not None and s.top_k is not None
        assert [t.token_id for t in b.top_k] == [t.token_id for t in s.top_k]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(b.top_k, s.top_k, strict=True)) <= 1e-4
    sizes = [r.timings.batch_size for r in bulk if isinstance(r, InferenceResult)]
    assert max(sizes) == 8  # a bulk message fills whole batches at once
    first = client.result(bulk_ids[0], wait=True, timeout_s=5)
    assert first is not None and client.status(bulk_ids[0]).value == "succeeded"

    # a plain Celery producer can send a bulk message; an invalid request fails alone under its own ID
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    summary = plain.send_task("fleet.infer_bulk", args=[{"requests": [
        {"request_id": "b-ok", "model": "demo-lm", "input_ids": [5, 6]},
        {"request_id": "b-bad", "model": "demo-lm", "input_ids": [5, 60000]},
    ]}], queue="fleet.demo-lm").get(timeout=30)
    ok, bad = client.wait(["b-ok", "b-bad"], 10)
    assert isinstance(ok, InferenceResult) and ok.request_id == "b-ok"
    assert isinstance(bad, TokenOutOfRange) and bad.field == "input_ids[1]"
    assert summary == {"count": 2, "succeeded": 1, "failed": 1, "outcomes": {"succeeded": 1, "invalid": 1},
                       "queue_wait_ms": [ok.timings.queue_wait_ms]}
    plain.close()

    # every request of a bulk message counts like a fleet.infer one: by outcome, queue wait, drain meter
    served = 300 + 20 + 1

    def counted() -> dict[Any, float] | None:
        w = scrape(f"http://127.0.0.1:{port}/metrics")
        done = w[("fleet_worker_requests_total", (("model", "demo-lm"), ("outcome", "succeeded")))]
        return w if done >= served else None

    w = wait_until(counted, 10, "the worker's request metrics")
    assert w[("fleet_worker_requests_total", (("model", "demo-lm"), ("outcome", "succeeded")))] == served
    assert w[("fleet_worker_requests_total", (("model", "demo-lm"), ("outcome", "invalid")))] == 1
    assert w[("fleet_worker_queue_wait_seconds_count", (("model", "demo-lm"),))] == served
    r = redis.Redis.from_url(fleet.redis_url)

    def drained() -> int | None:  # the drain meter writes its counts twice a second (workers.drain_meter)
        total = sum(int(r.get(k) or 0) for k in r.scan_iter(DRAIN_KEY.format(model="demo-lm", second="*")))
        return total if total >= served + 1 else None

    assert wait_until(drained, 10, "the drain meter's counts") == served + 1


def test_bulk_refuses_bad_input_before_queueing(fleet: Fleet) -> None:
    client = fleet.client(fleet.config())
    with pytest.raises(TokenOutOfRange):
        client.submit_bulk("demo-lm", [[1, 2], [1, 70000]])
    with pytest.raises(InvalidRequest, match="chunk_size"):
        client.submit_bulk("demo-lm", [[1]], chunk_size=0)


def test_a_bulk_message_never_replaces_a_stored_result_and_an_unnamed_item_fails_alone(fleet: Fleet) -> None:
    """A plain Celery bulk message naming a finished request stored its own result over it (a plain SETEX),
    and one item without a usable request ID failed the whole message: its siblings never got a result."""
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    known = client.submit("demo-lm", [5, 6, 7], request_id="bulk-known")
    assert client.result(known, wait=True, timeout_s=60) is not None
    stored = r.get(f"celery-task-meta-{known}")
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    summary = plain.send_task("fleet.infer_bulk", args=[{"requests": [
        {"request_id": known, "model": "demo-lm", "input_ids": [8, 9, 10, 11, 12, 13, 14]},
        {"request_id": "bulk-fresh", "model": "demo-lm", "input_ids": [5, 6]},
        {"request_id": "bulk-fresh", "model": "demo-lm", "input_ids": [7, 8, 9]},  # the same ID, another body: refused
        {"request_id": "", "model": "demo-lm", "input_ids": [5]},
        {"model": "demo-lm", "input_ids": [5]},
    ]}], queue="fleet.demo-lm").get(timeout=60)
    plain.close()
    assert r.get(f"celery-task-meta-{known}") == stored  # byte for byte
    fresh = client.result("bulk-fresh", wait=True, timeout_s=10)
    assert isinstance(fresh, InferenceResult)
    assert summary["count"] == 5 and summary["failed"] == 3, summary
    assert [e["index"] for e in summary["refused"]] == [2, 3, 4], summary  # no ID of their own to store under
    assert summary["refused"][0]["type"] == "IdempotencyConflict" and summary["refused"][0]["field"] == (
        "requests[2].request_id"), summary

    # an item named with the message's own task ID: its result went where the summary goes (the first stored is
    # kept), so the summary, the only place the refused items are said, was never stored
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    summary = plain.send_task("fleet.infer_bulk", args=[{"requests": [
        {"request_id": "bulk-self", "model": "demo-lm", "input_ids": [5, 6]},
        {"request_id": "bulk-other", "model": "demo-lm", "input_ids": [7, 8]},
        {"model": "demo-lm", "input_ids": [5]},
    ]}], queue="fleet.demo-lm", task_id="bulk-self").get(timeout=60)
    plain.close()
    assert isinstance(summary, dict) and summary["count"] == 3, summary  # the summary, not an inference result
    assert [(e["index"], e["field"]) for e in summary["refused"]] == [
        (0, "requests[0].request_id"), (2, "requests[2].request_id")], summary
    assert "own task ID" in summary["refused"][0]["message"], summary
    assert isinstance(client.result("bulk-other", wait=True, timeout_s=10), InferenceResult)


@pytest.mark.parametrize("call", ["submit_bulk", "submit_many"])
def test_queue_full_midway_says_which_requests_were_queued(fleet: Fleet, call: str) -> None:
    """A batch call refused by the queue's cap after it queued earlier chunks raises QueueFull with their IDs in
    ``queued_ids``, in input order (before, the caller never learnt the IDs of what stayed queued); a chunk larger
    than the cap is refused up front as InvalidRequest naming chunk_size (it never passes, even on an empty queue)."""
    cfg = fleet.config(models={"demo-encoder": {"max_queue_depth": 10}}, admission={"queue_depth_cache_ms": 0})
    client = fleet.client(cfg)  # no encoder worker: what is queued stays
    inputs = [[i + 1, 2] for i in range(25)]
    if call == "submit_bulk":
        with pytest.raises(InvalidRequest) as too_big:
            client.submit_bulk("demo-encoder", inputs[:11], chunk_size=100)
        assert too_big.value.field == "chunk_size" and too_big.value.limit == 10
        assert redis.Redis.from_url(fleet.redis_url).llen("fleet.demo-encoder") == 0
    if call == "submit_bulk":
        client.submit_many("demo-encoder", [[100 + i] for i in range(7)], progress=False)  # 7 messages wait
    with pytest.raises(QueueFull) as info:
        if call == "submit_bulk":  # the cap counts messages: 7 + 3 fits, then 8 + 3 does not
            client.submit_bulk("demo-encoder", inputs, chunk_size=3)
        else:
            client.submit_many("demo-encoder", inputs, progress=False)
    queued = info.value.queued_ids
    assert len(queued) == (3 if call == "submit_bulk" else 10)
    assert all(client.status(rid).value == "queued" for rid in queued)
    assert redis.Redis.from_url(fleet.redis_url).llen("fleet.demo-encoder") == (8 if call == "submit_bulk" else 10)
