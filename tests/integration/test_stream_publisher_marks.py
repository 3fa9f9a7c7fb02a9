"""The stream publisher's per-stream marks are bounded by forgetting the oldest, not by clearing them all.

Real redis-server, a real :class:`~workers.stream_publisher.StreamPublisher` thread. The publisher collects
the tokens of open streams once per window (a later token does not wake it); it knows which streams are open
from a bounded map. Before, that map was a set cleared at its cap (100,000): a stream still open when the cap
was reached was forgotten with the stale ones, and once the streams opened after it had ended its tokens sat
in the queue until something else woke the publisher (an idle publisher waits up to ``IDLE_WAIT_S``).
Here the cap is 2 and the idle wait an hour, so "until something else" is "never" within the test's bound.
"""

from __future__ import annotations

import pytest

from protocol.keys import STREAM_KEY
from protocol.streams import StreamEvent
from tests.integration.ops_fixtures import wait_until
from tools.redis_server import EmbeddedRedis
from workers import stream_publisher
from workers.stream_publisher import StreamPublisher


def test_a_stream_open_past_the_cap_is_still_collected_every_window(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_publisher, "IDLE_WAIT_S", 3600.0)  # only a window or a wake moves a token
    client = redis_server.client()
    publisher = StreamPublisher(redis_server.client(), ttl_s=60, window_ms=5, max_open_streams=2)

    def entries(rid: str) -> int:
        return int(client.xlen(STREAM_KEY.format(id=rid)))

    publisher.start()
    try:
        publisher.publish_token("never-ends", 0, 1, "x")  # a stream whose end never comes: what the cap is for
        wait_until(lambda: entries("never-ends") == 1, 10, "the stale stream's first token")
        publisher.publish_token("open", 0, 2, "o0")
        wait_until(lambda: entries("open") == 1, 10, "the open stream's first token")
        publisher.publish_token("short", 0, 3, "s0")  # the third open stream: past the cap of 2
        wait_until(lambda: entries("short") == 1, 10, "the short stream's first token")
        publisher.publish("short", StreamEvent(type="final", index=1, finish_reason="length"))
        wait_until(lambda: entries("short") == 2, 10, "the short stream's end")
        assert "open" in publisher._open and "never-ends" not in publisher._open  # old: both forgotten
        publisher.publish_token("open", 1, 4, "o1")  # wakes nobody: the next window collects it
        wait_until(lambda: entries("open") == 2, 10, "the open stream's second token, within a window")
        assert publisher._open.forgotten == 1
    finally:
        publisher.stop()
