"""``workers.drain_meter``: per-second dequeue counts written twice a second, against a real redis-server."""

from __future__ import annotations

import redis

from protocol.keys import DRAIN_KEY
from tools.redis_server import EmbeddedRedis
from workers.drain_meter import DrainMeter


def test_counts_are_written_per_second_in_one_flush_and_kept_while_redis_is_away(redis_server: EmbeddedRedis) -> None:
    r = redis.Redis(port=redis_server.port)
    meter = DrainMeter("m", lambda: r, window_s=30, flush_interval_s=3600)  # flushed by hand here
    try:
        for _ in range(5):
            meter.add(1, now_unix_s=1000.2)
        meter.add(3, now_unix_s=1001.7)
        meter.add(0, now_unix_s=1001.7)
        assert r.get(DRAIN_KEY.format(model="m", second=1000)) is None  # nothing written per request
        assert meter.flush()
        assert int(r.get(DRAIN_KEY.format(model="m", second=1000)) or 0) == 5
        assert int(r.get(DRAIN_KEY.format(model="m", second=1001)) or 0) == 3
        assert 0 < r.ttl(DRAIN_KEY.format(model="m", second=1000)) <= 35
        down = redis.Redis(port=1, socket_connect_timeout=0.2)  # nothing listens there
        away = DrainMeter("m", lambda: down, window_s=30, flush_interval_s=3600)
        away.add(2, now_unix_s=1000.5)
        assert not away.flush()  # kept for the next try
        away._client = lambda: r
        assert away.flush()
        assert int(r.get(DRAIN_KEY.format(model="m", second=1000)) or 0) == 7
        away.close()
    finally:
        meter.add(4, now_unix_s=1002.0)
        meter.close()  # what is pending is written at shutdown
    assert int(r.get(DRAIN_KEY.format(model="m", second=1002)) or 0) == 4
