"""A heartbeat hook that fails (a bug, or Redis refusing its command) never stops the heartbeat."""

from __future__ import annotations

import json

import redis

from protocol.keys import WORKER_KEY_PREFIX
from tests.integration.ops_fixtures import wait_until
from tools.redis_server import EmbeddedRedis
from workers.health import Heartbeat


def test_a_failing_hook_is_logged_and_the_beat_and_later_hooks_go_on(redis_server: EmbeddedRedis) -> None:
    client = redis.Redis(port=redis_server.port)
    beats = iter(range(1, 100))
    heartbeat = Heartbeat(client, "w1@test", lambda: {"hostname": "w1@test", "model": "m", "n": next(beats)}, 60)
    seen: list[float] = []

    def broken(expires_unix_s: float) -> None:
        raise ValueError("a bug in a hook")

    def refused(expires_unix_s: float) -> None:
        client.execute_command("NO-SUCH-COMMAND")

    heartbeat.on_beat += [broken, refused, seen.append]
    heartbeat.beat()
    heartbeat.beat()
    doc = json.loads(client.get(WORKER_KEY_PREFIX + "w1@test") or b"{}")
    assert doc["n"] == 2  # both beats published
    assert len(seen) == 2 and seen[1] >= seen[0]  # the hook after the failing ones ran at every beat


def test_live_follows_whether_redis_takes_the_beats() -> None:
    """``Heartbeat.live`` (what the worker's ready gauge reads) turns false when Redis stops taking beats for a
    heartbeat's lifetime, as every reader of the heartbeat sees it, and true again once a beat lands."""
    with EmbeddedRedis() as server:
        client = redis.Redis(port=server.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        heartbeat = Heartbeat(client, "w2@test", lambda: {"hostname": "w2@test", "model": "m"}, 0.2)
        assert not heartbeat.live  # nothing published yet
        heartbeat.start()
        try:
            assert heartbeat.live
            server.kill()
            wait_until(lambda: not heartbeat.live, 30, "the heartbeat to count as gone while Redis is away")
            server.start()
            wait_until(lambda: heartbeat.live, 30, "the heartbeat to be live once Redis takes a beat again")
            assert client.exists(WORKER_KEY_PREFIX + "w2@test")
        finally:
            heartbeat.stop()
