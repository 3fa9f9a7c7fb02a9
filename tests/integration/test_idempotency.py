"""Idempotency keys mean what they say: a known request ID with the same body is the same request;
with a different body it is refused and nothing is queued."""

from __future__ import annotations

import pytest
import redis

from protocol.errors import IdempotencyConflict
from tests.integration.fleet_fixtures import Fleet


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
