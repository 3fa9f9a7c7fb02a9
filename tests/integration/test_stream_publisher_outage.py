"""The worker's stream publisher across a Redis SIGKILL + restart (no persistence), against a real redis-server.

Events published while Redis is dead are held and written, in order and with their token indexes,
once it answers again; past the hold's bound tokens are dropped (counted, logged) while the ends of
streams are kept, so readers can finish those streams from the stored results.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from protocol.keys import STREAM_KEY
from protocol.messages import Usage
from protocol.streams import StreamEvent, decode_events
from tests.integration.ops_fixtures import wait_until
from tools.redis_server import EmbeddedRedis
from workers.stream_metrics import StreamPublisherCollector
from workers.stream_outage import Outage
from workers.stream_publisher import StreamPublisher


def _token(i: int) -> StreamEvent:
    return StreamEvent(type="token", index=i, token_id=100 + i, text=f"<{i}>")


def _final(n: int) -> StreamEvent:
    return StreamEvent(type="final", index=n, finish_reason="length",
                       usage=Usage(prompt_tokens=2, completion_tokens=n, total_tokens=2 + n))


def _stream(client: redis.Redis[bytes], rid: str) -> list[tuple[str, int]]:
    try:
        entries = client.xrange(STREAM_KEY.format(id=rid))
    except redis.ConnectionError:
        return []
    return [(e.type, e.index) for _, fields in entries for e in decode_events(fields)]


class _Lines(logging.Handler):
    """The publisher's log lines (its logger may not propagate to pytest's capture)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _publish_while_dead(
    server: EmbeddedRedis, publisher: StreamPublisher, events: dict[str, list[StreamEvent]], lines: _Lines
) -> None:
    server.kill()
    for rid, evs in events.items():
        for event in evs:
            publisher.publish(rid, event)
    # the publisher meets the dead server (and says so) before it comes back
    wait_until(lambda: lines.lines, 10, "the publisher to log that Redis does not answer")
    server.start()


@pytest.fixture
def publisher_warnings() -> Iterator[None]:
    """The publisher's warnings are emitted whatever level an earlier test left on the root logger."""
    logger = logging.getLogger("fleet.streams")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


@pytest.mark.usefixtures("publisher_warnings")
def test_events_published_while_redis_is_dead_are_written_in_order_when_it_is_back() -> None:
    lines = _Lines()
    logging.getLogger("fleet.streams").addHandler(lines)
    with EmbeddedRedis() as server:
        client = server.client()
        publisher = StreamPublisher(server.client(socket_timeout=5), ttl_s=60)
        publisher.start()
        try:
            for i in range(3):
                publisher.publish("r1", _token(i))
            wait_until(lambda: len(_stream(client, "r1")) == 3, 10, "the first 3 tokens written")
            _publish_while_dead(server, publisher, {"r1": [*(_token(i) for i in range(3, 8)), _final(8)]}, lines)
            want = [("token", i) for i in range(3, 8)] + [("final", 8)]  # the restart emptied Redis
            wait_until(lambda: _stream(client, "r1") == want, 20, "the held events written in order")
            assert client.ttl(STREAM_KEY.format(id="r1")) > 0
            assert publisher.dropped == 0 and len(publisher.pending) == 0
            wait_until(lambda: any("wrote 6 held events, 0 dropped" in line for line in lines.lines), 10,
                       "the outage's end logged")
            assert any("holding" in line for line in lines.lines), lines.lines
        finally:
            publisher.stop(timeout_s=5)
            client.close()
            logging.getLogger("fleet.streams").removeHandler(lines)


def test_past_the_bound_tokens_are_dropped_and_the_ends_kept() -> None:
    with EmbeddedRedis() as server:
        client = server.client()
        publisher = StreamPublisher(server.client(socket_timeout=5), ttl_s=60, max_held_events=4)
        publisher.start()
        try:
            publisher.publish("warm", _token(0))
            wait_until(lambda: len(_stream(client, "warm")) == 1, 10, "a first write")
            events = {"a": [_token(i) for i in range(10)] + [_final(10)], "b": [_token(0), _final(1)]}
            server.kill()
            publisher.publish("warm", _token(1))  # the write that meets the dead server, then the bound applies
            wait_until(lambda: len(publisher.pending) > 0, 10, "the publisher to meet the dead server")
            for rid, evs in events.items():
                for event in evs:
                    publisher.publish(rid, event)
            wait_until(lambda: publisher.dropped > 0, 10, "the bound to be reached")
            server.start()
            wait_until(lambda: _stream(client, "a")[-1:] == [("final", 10)] and _stream(client, "b")[-1:]
                       == [("final", 1)], 20, "both streams' ends written")
            a = _stream(client, "a")
            tokens = [i for t, i in a if t == "token"]
            assert tokens == list(range(len(tokens))) and len(tokens) < 10  # a prefix, then the gap
            assert publisher.dropped == 10 - len(tokens) + (0 if ("token", 0) in _stream(client, "b") else 1)
            registry = CollectorRegistry()
            registry.register(StreamPublisherCollector("demo-lm", publisher))
            scraped = generate_latest(registry).decode()
            assert f'fleet_worker_stream_events_dropped_total{{model="demo-lm"}} {float(publisher.dropped)}' in scraped
            assert 'fleet_worker_stream_events_held{model="demo-lm"} 0.0' in scraped, scraped
        finally:
            publisher.stop(timeout_s=5)
            client.close()


def test_stop_while_redis_is_dead_gives_up_at_its_deadline_not_at_the_next_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An outage whose next retry is an hour off (the schedule stretched, as a long outage's waits are)
    must not keep a stopping publisher: it gives up at the stop's deadline with the event unwritten.
    Waited on as the thread's end; the 60 s bound only names a publisher that never gave up."""
    monkeypatch.setattr(Outage, "next_wait_s", lambda self, now_s: 3600.0)
    with EmbeddedRedis() as server:
        publisher = StreamPublisher(server.client(socket_timeout=2), ttl_s=60)
        publisher.start()
        server.kill()
        publisher.publish("r", _token(0))
        wait_until(lambda: len(publisher.pending) > 0, 10, "the publisher to hold the event")
        publisher.stop(timeout_s=1)
        publisher._thread.join(60)
        assert not publisher._thread.is_alive(), "the stopping publisher waited for a retry past its deadline"
        assert len(publisher.pending) == 1  # given up, not written
