"""One message must never stop the fleet: malformed deliveries are failed, dead-lettered and acked."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis

from protocol.deadletter import DeadLetter, Reason, read_entry
from protocol.errors import DecodeError, FleetError
from protocol.keys import DEAD_LETTER_KEY
from tests.integration.fleet_fixtures import Fleet
from tests.queue_items import envelope, good_body, pickle_item, raw

QUEUE = "fleet.demo-lm"
REQUEST = {"model": "demo-lm", "input_ids": [5, 6, 7], "output": {"top_k": 3}}


def _dead_letters(r: redis.Redis[bytes]) -> list[DeadLetter]:
    return [read_entry(item) for item in r.lrange(DEAD_LETTER_KEY, 0, -1)]


def _json_object_body(task_id: str) -> bytes:
    # Celery unpacks the body as `args, kwargs, embed`: a one-key object raised ValueError in the
    # worker's event loop ("not enough values to unpack (expected 3, got 1)") and the worker exited
    return raw(envelope(QUEUE, json.dumps({"request": REQUEST}).encode(), task_id=task_id))


def _non_json_body(task_id: str) -> bytes:
    return raw(envelope(QUEUE, b"\x00this is not JSON {", task_id=task_id))


def _pickle(task_id: str) -> bytes:
    return pickle_item(QUEUE, REQUEST, task_id)


CASES: list[tuple[str, Any, Reason, str]] = [
    ("json-object-body", _json_object_body, Reason.BAD_BODY, "body"),
    ("pickle", _pickle, Reason.PICKLE, "content-type"),
    ("non-json-body", _non_json_body, Reason.BODY_NOT_JSON, "body"),
]


@pytest.mark.parametrize(("name", "make_item", "reason", "field"), CASES, ids=[c[0] for c in CASES])
def test_malformed_message_is_failed_dead_lettered_and_the_worker_serves_on(
    fleet: Fleet, name: str, make_item: Any, reason: Reason, field: str
) -> None:
    cfg = fleet.config()
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    task_id = f"poison-{name}-{uuid.uuid4().hex[:8]}"
    item = make_item(task_id)
    r.lpush(QUEUE, item)
    good = client.submit("demo-lm", [5, 6, 7])  # queued behind the poison item
    result = client.result(good, wait=True, timeout_s=30)
    assert result is not None and result.top_k
    assert worker.proc is not None and worker.proc.poll() is None, worker.log_tail()
    # the malformed message's own ID gets a FAILURE naming the field that broke
    with pytest.raises(FleetError) as info:
        client.result(task_id, wait=True, timeout_s=10)
    assert isinstance(info.value, DecodeError), info.value
    assert info.value.field is not None and info.value.field.startswith(field), info.value.field
    # and the raw item is kept, with why and where
    entries = _dead_letters(r)
    assert [e.task_id for e in entries] == [task_id]
    entry = entries[0]
    assert entry.reason is reason and entry.queue == QUEUE and entry.raw_bytes() == item
    assert entry.field is not None and entry.field.startswith(field)
    assert r.llen(QUEUE) == 0
    # it never reached the pool, and the worker never restarted
    assert worker.proc.poll() is None
    assert "Unrecoverable error" not in worker.log_tail(200_000)


def test_a_legitimate_celery_message_still_runs(fleet: Fleet) -> None:
    """The guard's own envelope (hand-built like Celery's) passes and computes."""
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    task_id = uuid.uuid4().hex
    r.lpush(QUEUE, raw(envelope(QUEUE, good_body(REQUEST), task_id=task_id)))
    result = client.result(task_id, wait=True, timeout_s=30)
    assert result is not None and result.top_k is not None and len(result.top_k) == 3
    assert r.llen(DEAD_LETTER_KEY) == 0
