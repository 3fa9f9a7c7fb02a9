"""producer.streams against a real redis-server: XREAD BLOCK from the start, replays dropped, the end, silence.

A writer appends events the way a worker does (``XADD`` of :func:`protocol.streams.encode_event`),
from a thread for the sync reader and from a task on the reader's own loop for the async one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio

from producer.streams import aiter_events, iter_events
from protocol.errors import ResultTimeout
from protocol.keys import STREAM_KEY
from protocol.messages import Usage
from protocol.streams import StreamEvent, encode_event
from tools.redis_server import EmbeddedRedis

# a worker killed after two tokens, then the redelivered attempt from index 0 to the end
REPLAYED = [
    StreamEvent(type="token", index=i, token_id=10 + i, text=f"<{i}>") for i in (0, 1, 0, 1, 2, 3)
] + [
    StreamEvent(
        type="final", index=4, finish_reason="length", usage=Usage(prompt_tokens=2, completion_tokens=4, total_tokens=6)
    )
]


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture
def client(server: EmbeddedRedis) -> Iterator[redis.Redis[bytes]]:
    c: redis.Redis[bytes] = redis.Redis.from_url(server.url)
    c.flushall()
    try:
        yield c
    finally:
        c.close()


def _write(client: redis.Redis[bytes], rid: str, events: list[StreamEvent], gap_s: float) -> None:
    for event in events:
        time.sleep(gap_s)  # the writer's pace, not synchronisation: the reader blocks in XREAD meanwhile
        client.xadd(STREAM_KEY.format(id=rid), encode_event(event))


def _texts(events: list[StreamEvent]) -> list[tuple[str, int, str]]:
    return [(e.type, e.index, e.text) for e in events]


EXPECTED = [("token", 0, "<0>"), ("token", 1, "<1>"), ("token", 2, "<2>"), ("token", 3, "<3>"), ("final", 4, "")]


def test_sync_reader_waits_for_the_stream_and_drops_the_replay(client: redis.Redis[bytes]) -> None:
    writer = threading.Thread(target=_write, args=(client, "s1", REPLAYED, 0.02))
    writer.start()  # the key does not exist yet when the reader starts
    try:
        got = list(iter_events(client, "s1", timeout_s=10, block_ms=100))
    finally:
        writer.join()
    assert _texts(got) == EXPECTED
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == 4


def test_async_reader_same_events(server: EmbeddedRedis, client: redis.Redis[bytes]) -> None:
    async def read() -> list[StreamEvent]:
        aredis: redis.asyncio.Redis[bytes] = redis.asyncio.Redis.from_url(server.url)
        try:
            writer = asyncio.create_task(asyncio.to_thread(_write, client, "a1", REPLAYED, 0.02))
            got = [event async for event in aiter_events(aredis, "a1", timeout_s=10, block_ms=100)]
            await writer
            return got
        finally:
            await aredis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose

    assert _texts(asyncio.run(read())) == EXPECTED


def test_finished_stream_reads_at_once_and_readers_agree(
    server: EmbeddedRedis, client: redis.Redis[bytes]
) -> None:
    _write(client, "done", REPLAYED, 0)

    async def read() -> list[StreamEvent]:
        aredis: redis.asyncio.Redis[bytes] = redis.asyncio.Redis.from_url(server.url)
        try:
            return [event async for event in aiter_events(aredis, "done", timeout_s=1)]
        finally:
            await aredis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose

    assert _texts(asyncio.run(read())) == _texts(list(iter_events(client, "done", timeout_s=1))) == EXPECTED


def test_error_event_ends_the_stream(client: redis.Redis[bytes]) -> None:
    error = StreamEvent(type="error", index=0, error="expired", message="deadline passed", field="deadline_unix_s")
    _write(client, "e1", [error, StreamEvent(type="token", index=0, token_id=1)], 0)
    got = list(iter_events(client, "e1", timeout_s=1))
    assert [(e.type, e.error) for e in got] == [("error", "expired")]


def test_silence_raises_result_timeout(server: EmbeddedRedis, client: redis.Redis[bytes]) -> None:
    _write(client, "t1", REPLAYED[:2], 0)  # two tokens, then the worker goes quiet
    seen: list[StreamEvent] = []
    started = time.monotonic()
    with pytest.raises(ResultTimeout, match="after token 1") as info:
        seen.extend(iter_events(client, "t1", timeout_s=0.3, block_ms=100))
    assert len(seen) == 2 and info.value.limit == 0.3 and time.monotonic() - started < 5

    async def read_nothing() -> None:
        aredis: redis.asyncio.Redis[bytes] = redis.asyncio.Redis.from_url(server.url)
        try:
            async for _ in aiter_events(aredis, "never", timeout_s=0.3, block_ms=100):
                pytest.fail("the stream has no entries")
        finally:
            await aredis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose

    with pytest.raises(ResultTimeout, match="no event in the stream of never"):
        asyncio.run(read_nothing())
