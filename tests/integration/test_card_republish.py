"""A worker publishes its model card again where Redis lost it (a restart without persistence, a flush): a
producer on a machine without the model's files reads the tokenizer and limits there, and refused text
("has no tokenizer on this machine") until the worker restarted (real worker, real redis-server)."""

from __future__ import annotations

import redis

from protocol.keys import CARD_KEY
from tests.integration.fleet_fixtures import Fleet
from tools.processes import poll_until


def test_a_lost_model_card_is_published_again_by_the_worker_s_heartbeat(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    key = CARD_KEY.format(model="demo-lm")
    card = r.get(key)
    assert card is not None
    r.flushall()  # what a Redis restart without persistence leaves
    assert poll_until(lambda: r.get(key), 30, "the model card published again") == card
