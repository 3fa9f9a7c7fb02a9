"""Token events coalesced per stream: one XADD carries every pending event of a stream, in order.

Against a real redis-server: the publisher puts a stream's pending tokens and its final event into one
entry, and a reader (``producer.streams.StreamCursor``, what ``FleetClient.stream``
and the gateway use) hands on every event once, in order; events of different streams never share an
entry; a redelivered stream (indexes from 0 again) is still read once. The publisher counts entries and
its own CPU time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from producer.streams import StreamCursor
from protocol.keys import STREAM_KEY
from protocol.messages import Usage
from protocol.streams import StreamEvent
from tests.integration.ops_fixtures import wait_until
from tools.redis_server import EmbeddedRedis
from workers import stream_publisher
from workers.stream_publisher import MAX_EVENTS_PER_ENTRY, StreamPublisher


def _events(count: int) -> list[StreamEvent]:
    tokens = [StreamEvent(type="token", index=i, token_id=100 + i, text=f"<{i}>") for i in range(count)]
    return [*tokens, StreamEvent(type="final", index=count, finish_reason="length",
                                 usage=Usage(prompt_tokens=1, completion_tokens=count, total_tokens=1 + count))]


def _read(client: redis.Redis[bytes], rid: str) -> list[StreamEvent]:
    cursor = StreamCursor(rid, now_s=time.monotonic(), timeout_s=5)
    reply = client.xread({STREAM_KEY.format(id=rid): "0-0"}, count=1000)
    return cursor.read(reply, time.monotonic())


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


def test_a_streams_pending_burst_goes_out_as_one_entry_read_whole_and_in_order(server: EmbeddedRedis) -> None:
    client = server.client()
    publisher = StreamPublisher(server.client(), ttl_s=60, window_ms=300)
    a, b = _events(10), _events(4)
    for i in range(10):  # two streams interleaved, as decode steps emit them, queued before the thread runs
        publisher.publish("a", a[i])
        if i < len(b):
            publisher.publish("b", b[i])
    publisher.publish("a", a[10])
    publisher.start()
    try:
        wait_until(lambda: publisher.published == 16, 10, "the 16 events to be written")
        assert client.xlen(STREAM_KEY.format(id="a")) == 1 and client.xlen(STREAM_KEY.format(id="b")) == 1
        assert publisher.entries == 2
        assert _read(client, "a") == a
        assert _read(client, "b") == b
        assert client.ttl(STREAM_KEY.format(id="a")) > 0
        # a redelivered attempt writes indexes 0.. again: the reader still hands each on once
        for event in a:
            publisher.publish("a", event)
        wait_until(lambda: publisher.published == 27, 10, "the redelivered events to be written")
        assert _read(client, "a") == a
        assert publisher.cpu_s > 0
    finally:
        publisher.stop()


def test_without_a_window_a_long_burst_is_split_into_entries_of_at_most_the_cap(server: EmbeddedRedis) -> None:
    client = server.client()
    publisher = StreamPublisher(server.client(), ttl_s=60)
    events = _events(3 * MAX_EVENTS_PER_ENTRY)
    for event in events:  # queued before the thread starts: one write finds them all
        publisher.publish("long", event)
    publisher.start()
    try:
        wait_until(lambda: publisher.published == len(events), 10, "every event to be written")
        assert client.xlen(STREAM_KEY.format(id="long")) == 4  # 193 events: 64 + 64 + 64 + 1
        assert _read(client, "long") == events
    finally:
        publisher.stop()


def test_a_streams_first_token_is_written_at_once_with_what_is_pending(server: EmbeddedRedis) -> None:
    client = server.client()
    publisher = StreamPublisher(server.client(), ttl_s=60, window_ms=600_000)  # ten minutes: only urgency writes
    publisher.start()
    try:
        later = StreamEvent(type="token", index=5, token_id=105, text="<5>")
        publisher.publish("running", later)  # a later token waits out the window …
        first = StreamEvent(type="token", index=0, token_id=100, text="<0>")
        publisher.publish("new", first)  # … until a stream's first token is written, at once, with it
        wait_until(lambda: publisher.published == 2, 30, "the first token (and what was pending) to be written")
        assert _read(client, "new") == [first]
        assert client.xlen(STREAM_KEY.format(id="running")) == 1
    finally:
        publisher.stop(timeout_s=2)


def test_tokens_of_open_streams_are_collected_every_window_without_waking_the_publisher(
    server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``publish_token`` does not wake the publisher for a later token (the scheduler's cost per token is a
    queue put): while a stream is open the publisher collects every window on its own. With the idle wait
    made ten minutes long, only that collection can write them; texts with newlines, record separators and
    quotes come back as they went, whatever else shares the write."""
    monkeypatch.setattr(stream_publisher, "IDLE_WAIT_S", 600.0)
    client = server.client()
    publisher = StreamPublisher(server.client(), ttl_s=60, window_ms=50)
    publisher.start()
    texts = ["a\nb", "\x1e", '"q"', "\\", "é", ""]
    try:
        for rid in ("x", "y"):
            publisher.publish_token(rid, 0, 100, "<0>")  # a first token: written at once, the stream opens
        wait_until(lambda: publisher.published == 2, 30, "the first tokens")
        for i, text in enumerate(texts, start=1):
            publisher.publish_token("x", i, 100 + i, text)
            publisher.publish_token("y", i, 200 + i, text)
        wait_until(lambda: publisher.published == 2 + 2 * len(texts), 30, "the later tokens, collected by the window")
        for rid, base in (("x", 100), ("y", 200)):
            want = [StreamEvent(type="token", index=0, token_id=100, text="<0>")]
            want += [StreamEvent(type="token", index=i, token_id=base + i, text=t) for i, t in enumerate(texts, 1)]
            assert _read(client, rid) == want
            assert client.ttl(STREAM_KEY.format(id=rid)) > 0
    finally:
        publisher.stop()


def test_an_entry_redis_refuses_is_counted_and_the_other_streams_of_the_write_go_out(server: EmbeddedRedis) -> None:
    client = server.client()
    client.set(STREAM_KEY.format(id="bad"), "a string, not a stream")  # XADD answers WRONGTYPE, for good
    publisher = StreamPublisher(server.client(), ttl_s=60, window_ms=0)
    good, bad = _events(3), _events(2)
    for i in range(4):  # queued before the thread starts: one write holds both streams
        publisher.publish("good", good[i])
        if i < len(bad):
            publisher.publish("bad", bad[i])
    publisher.start()
    try:
        wait_until(lambda: publisher.published + publisher.refused == 7, 10, "the write")
        assert publisher.refused == 3 and publisher.dropped == 3 and publisher.published == 4
        assert _read(client, "good") == good
        assert client.get(STREAM_KEY.format(id="bad")) == b"a string, not a stream"
    finally:
        publisher.stop()
