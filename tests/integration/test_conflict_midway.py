"""A batch call stopped midway by an ID already known with another body says what it queued before.

``submit_many`` and ``submit_bulk`` send their requests in order (one by one, or a chunk at a time); an input
whose ID is known with another body is refused with ``IdempotencyConflict``, and the requests (chunks) before
it stay queued. Before, the exception carried nothing of them, so a caller with its own IDs could not tell
which would run; now it carries ``queued_ids``, as a QueueFull or RateLimited that stops the call does. A real
redis-server; the IDs are read back from the queue.
"""

from __future__ import annotations

import base64
import json

import pytest
import redis

from protocol.errors import IdempotencyConflict
from tests.integration.fleet_fixtures import Fleet

MODEL = "demo-lm"


def _queued_ids(r: redis.Redis[bytes], queue: str) -> list[str]:
    """The request IDs the queue's messages carry (one-step messages and bulk messages alike)."""
    ids: list[str] = []
    for raw in reversed(r.lrange(queue, 0, -1)):  # oldest first
        message = json.loads(raw)
        body = json.loads(base64.b64decode(message["body"]))
        args = body[0][0]
        ids.extend([str(x["request_id"]) for x in args["requests"]] if "requests" in args
                   else [message["headers"]["id"]])  # fmt: skip
    return ids


@pytest.mark.parametrize("call", ["submit_many", "submit_bulk"])
def test_a_known_id_with_another_body_midway_reports_what_was_queued_before(fleet: Fleet, call: str) -> None:
    cfg = fleet.config()
    client = fleet.client(cfg)
    queue = fleet.settings(cfg).queue_for(MODEL)
    r = redis.Redis.from_url(fleet.redis_url)
    client.submit(MODEL, [9, 9, 9], request_id="taken")  # known, with another body than below
    r.delete(queue)  # only the batch's messages are read back below
    ids = ["a-0", "a-1", "a-2", "taken", "a-4"]
    inputs = [[5, 6, i + 1] for i in range(len(ids))]
    with pytest.raises(IdempotencyConflict) as info:
        if call == "submit_many":
            client.submit_many(MODEL, inputs, request_ids=ids, progress=False)
        else:
            client.submit_bulk(MODEL, inputs, request_ids=ids, chunk_size=3, progress=False)
    queued = _queued_ids(r, queue)
    print(f"\n{call} stopped by a known ID with another body: queued_ids {info.value.queued_ids}; queue {queued}")
    assert info.value.queued_ids == queued == ["a-0", "a-1", "a-2"]
