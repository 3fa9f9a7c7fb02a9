"""Idempotency keys mean what they say: a known request ID with the same body is the same request;
with a different body it is refused and nothing is queued."""

from __future__ import annotations

import json

import pytest
import redis

from protocol.errors import IdempotencyConflict, RateLimited
from tests.integration.fleet_fixtures import Fleet
from tools.ledger import Ledger


def test_same_body_is_the_same_request_and_another_body_is_refused(fleet: Fleet) -> None:
    cfg = fleet.config()
    client = fleet.client(cfg)  # no worker: everything stays queued, so the queue length is the truth
    queue = client.settings.queue_for("demo-lm")
    r = redis.Redis.from_url(fleet.redis_url)
    assert client.submit("demo-lm", [5, 6, 7], request_id="key-1") == "key-1"
    assert client.submit("demo-lm", [5, 6, 7], request_id="key-1") == "key-1"
    assert r.llen(queue) == 1
    with pytest.raises(IdempotencyConflict, match="already known with a different body") as info:
        client.submit("demo-lm", [5, 6, 8], request_id="key-1")
    assert info.value.field == "request_id"
    with pytest.raises(IdempotencyConflict):
        client.submit("demo-lm", [5, 6, 7], request_id="key-1", top_k=9)
    with pytest.raises(IdempotencyConflict):
        client.submit("demo-lm", [5, 6, 7], request_id="key-1", generation={"max_new_tokens": 4})
    assert r.llen(queue) == 1


def test_python_client_draws_on_a_rate_key_bucket_like_the_gateway(fleet: Fleet) -> None:
    cfg = fleet.config(admission={"rate_capacity": 2, "rate_refill_per_s": 0.001})
    client = fleet.client(cfg)
    assert client.submit("demo-lm", [5], rate_key="team-a") and client.submit("demo-lm", [6], rate_key="team-a")
    with pytest.raises(RateLimited) as info:
        client.submit("demo-lm", [7], rate_key="team-a")
    assert info.value.retry_after_s >= 1
    assert client.submit("demo-lm", [8], rate_key="team-b")  # another caller's bucket
    assert client.submit("demo-lm", [9])  # no rate key: only the queue cap applies


def test_flower_sees_the_request_as_json_with_its_text(fleet: Fleet) -> None:
    cfg = fleet.config()
    client = fleet.client(cfg)
    rid = client.submit("demo-lm", text="Hi fleet", request_id="flower-args-1")
    raw = redis.Redis.from_url(fleet.redis_url).lindex(client.settings.queue_for("demo-lm"), 0)
    headers = json.loads(raw)["headers"]
    shown = json.loads(headers["argsrepr"])
    assert shown[0]["text"] == "Hi fleet" and shown[0]["request_id"] == rid
    assert shown[0]["input_ids"] == [b + 3 for b in b"Hi fleet"]
    assert headers["kwargsrepr"] == "{}"


ONE_AT_A_TIME = {"worker": {"concurrency": 1}, "models": {"demo-lm": {"batching": {"max_batch_size": 1}}}}
"""One worker thread: requests run in queue order, so a request served proves every earlier one ran."""


def test_submit_bulk_under_a_finished_id_is_refused_and_its_result_never_changes(fleet: Fleet) -> None:
    cfg = fleet.config(**ONE_AT_A_TIME)
    fleet.worker(cfg, concurrency=1)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    assert client.submit("demo-lm", [5, 6, 7], request_id="known-1") == "known-1"
    first = client.result("known-1", wait=True, timeout_s=60)
    assert first is not None and first.input_tokens == 3
    stored = r.get(client.app.backend.get_key_for_task("known-1"))
    marker = r.get("fleet:req:known-1")
    ledger = Ledger(r, [client.settings.queue_for("demo-lm")])
    ledger.accepted("known-1")
    ledger.observe()  # its first terminal state: a later change is a terminal_changed violation

    refused: Exception | None = None
    try:
        client.submit_bulk("demo-lm", [[8, 9, 10, 11, 12, 13, 14]], request_id="known-1")
    except IdempotencyConflict as exc:
        refused = exc
    # the same body under the known ID is that request: its ID, nothing queued (bulk and single paths)
    assert client.submit_bulk("demo-lm", [[5, 6, 7]], request_id="known-1") == ["known-1"]
    assert client.submit_many("demo-lm", [[5, 6, 7]], request_id="known-1", progress=False) == ["known-1"]
    # a request queued after all of that is served only after everything queued before it ran
    assert client.wait(client.submit_bulk("demo-lm", [[4]]), 60)[0] is not None
    assert r.get(client.app.backend.get_key_for_task("known-1")) == stored, "the finished result was replaced"
    assert r.get("fleet:req:known-1") == marker
    assert isinstance(refused, IdempotencyConflict), "submit_bulk accepted another body under a finished ID"
    assert refused.field == "inputs[0].request_id" and "nothing was queued" in refused.message

    # two inputs under one ID: refused before anything is queued, naming the second input
    with pytest.raises(IdempotencyConflict) as two:
        client.submit_bulk("demo-lm", [[1, 2], [3, 4]], request_id="two-1")
    assert two.value.field == "inputs[1].request_id"
    with pytest.raises(IdempotencyConflict):
        client.submit_many("demo-lm", [[1, 2], [3, 4]], request_id="two-1", progress=False)
    assert client.wait(client.submit_bulk("demo-lm", [[4]]), 60)[0] is not None
    assert r.get("fleet:req:two-1") is None and r.get(client.app.backend.get_key_for_task("two-1")) is None
    ledger.refused("two-1")
    ledger.check_settled(30).raise_if_broken()


def test_an_id_keeps_its_body_as_long_as_its_result_lives(fleet: Fleet) -> None:
    """A request's marker (which body its ID names) lives as long as its result: the result store gives it the
    result's time to live. Before, the marker kept the TTL it got at submit and expired a queue wait and a run
    before the result; in between, a resubmit with another body was answered with the first body's result
    instead of refused. The test gives the marker a TTL unlike any the fleet gives (a day) before a worker runs
    the request: the result store must replace it with the result's. (It shortened the TTL to 3 s instead, and
    beside a CPU hog the worker took longer than that to start: the marker had expired before the store.)"""
    cfg = fleet.config()
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    rid = client.submit("demo-lm", [5, 6, 7], request_id="key-long-wait")
    marker = f"fleet:req:{rid}"
    assert r.expire(marker, 86_400)
    fleet.worker(cfg)
    assert client.result(rid, wait=True, timeout_s=60) is not None
    result_ttl = r.ttl(f"celery-task-meta-{rid}")
    assert 0 < result_ttl - 1 <= r.ttl(marker) <= result_ttl, (r.ttl(marker), result_ttl)  # the result's, not a day
    with pytest.raises(IdempotencyConflict, match="already known with a different body"):
        client.submit("demo-lm", [5, 6, 8], request_id=rid)
    assert client.submit("demo-lm", [5, 6, 7], request_id=rid) == rid  # the same body is still the same request
