"""The gateway's metrics count dead letters by reason, across worker restarts (real redis-server, a real
worker that refuses the items, a real gateway scraped over HTTP).

Before, nothing counted them: an operator learned of a poison flood only by running ``fleet dead-letter list``.
"""

from __future__ import annotations

import json

import redis

from protocol.keys import DEAD_LETTER_KEY
from tests.integration.ops_fixtures import OpsFleet, ops_fleet, ops_models, ops_redis, scrape, wait_until
from tests.queue_items import envelope, raw

__all__ = ["ops_fleet", "ops_models", "ops_redis"]

QUEUE = "fleet.demo-lm"


def test_dead_letters_are_counted_by_reason_and_the_count_outlives_the_worker(ops_fleet: OpsFleet) -> None:
    config = ops_fleet.config()
    gateway = ops_fleet.gateway(config)
    r = redis.Redis.from_url(ops_fleet.redis_url)
    r.lpush(QUEUE, b"not json at all", raw(envelope(QUEUE, b"{broken")), b"\xff\xfe")
    worker = ops_fleet.worker(config)
    wait_until(lambda: r.llen(DEAD_LETTER_KEY) == 3, 60, "the worker to dead-letter the 3 items")
    reasons = sorted(json.loads(entry)["reason"] for entry in r.lrange(DEAD_LETTER_KEY, 0, -1))

    def counts() -> dict[str, float]:
        return {dict(labels)["reason"]: value for (name, labels), value in scrape(gateway.url + "/metrics").items()
                if name == "fleet_dead_lettered_total"}  # fmt: skip

    expected = {reason: float(reasons.count(reason)) for reason in reasons}
    assert counts() == expected
    assert scrape(gateway.url + "/metrics")[("fleet_dead_letter_entries", ())] == 3
    worker.stop()
    ops_fleet.worker(config)  # a new process: the count lives in Redis
    r.lpush(QUEUE, b"still not json")
    wait_until(lambda: r.llen(DEAD_LETTER_KEY) == 4, 60, "the new worker to dead-letter one more")
    after = counts()
    assert sum(after.values()) == 4 and all(after.get(k, 0) >= v for k, v in expected.items()), after
