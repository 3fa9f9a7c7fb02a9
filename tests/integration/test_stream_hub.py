"""One XREAD for every relayed stream (:mod:`gateway.stream_hub`), on a real redis-server: the streams
a worker writes in one step are all answered by one read; a reader keeps its own position; a stream
that joins while a read is under way is not kept waiting for it; a Redis error reaches every reader
waiting on the read; a stream read through the hub hands on each event once, as a lone reader does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio

from gateway.stream_hub import StreamHub, stream_id
from producer.streams import aiter_events
from protocol.keys import STREAM_KEY
from protocol.streams import StreamEvent, encode_event
from tools.redis_server import EmbeddedRedis

KEYS = [f"hub-test:{i}" for i in range(10)]


def _xreads(url: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


@contextlib.asynccontextmanager
async def _hub(url: str, block_ms: int = 2000) -> AsyncIterator[tuple[redis.asyncio.Redis[bytes], StreamHub]]:
    client = redis.asyncio.Redis.from_url(url, max_connections=64)
    hub = StreamHub(client, block_ms=block_ms)
    try:
        yield client, hub
    finally:
        await hub.aclose()
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


async def _write_all(client: redis.asyncio.Redis[bytes], keys: list[str], value: str) -> None:
    """One entry in each stream, in one atomic step (the worker's publisher writes a window's events with
    one script; commands sent one by one would each wake the read)."""
    async with client.pipeline(transaction=True) as pipe:
        for key in keys:
            pipe.xadd(key, {"v": value})
        await pipe.execute()


async def _registered(hub: StreamHub, count: int) -> None:
    for _ in range(10_000):  # each pass yields to the loop: an event, not a time window
        if sum(len(w) for w in hub._waiting.values()) >= count and hub._reading:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never {count} readers in the hub's read")


def test_streams_written_together_are_answered_by_one_read(redis_server: EmbeddedRedis) -> None:
    async def main() -> None:
        async with _hub(redis_server.url) as (client, hub):
            last = dict.fromkeys(KEYS, "0-0")
            for round_ in range(3):
                reads = [asyncio.create_task(hub.xread(key, last[key], 30_000)) for key in KEYS]
                await _registered(hub, len(KEYS))
                reads_before = hub.reads
                await _write_all(client, KEYS, f"r{round_}")
                got = await asyncio.gather(*reads)
                assert [[fields[b"v"] for _, fields in entries] for entries in got] == [[f"r{round_}".encode()]] * 10
                assert hub.reads == reads_before  # the read under way answered all ten
                for key, entries in zip(KEYS, got, strict=True):
                    last[key] = entries[-1][0]
            assert hub.reads == 3  # one blocking read per round (+ one without blocking on Redis < 7)
            assert _xreads(redis_server.url) <= 3 * 3  # and no reader read on its own (Redis counts a blocked
            # XREAD when it blocks and again when it is served)

    asyncio.run(main())


def test_each_reader_gets_the_entries_after_its_own_position(redis_server: EmbeddedRedis) -> None:
    async def main() -> None:
        async with _hub(redis_server.url) as (client, hub):
            first = await client.xadd(KEYS[0], {"v": "a"})
            behind = asyncio.create_task(hub.xread(KEYS[0], "0-0", 30_000))
            assert [f[b"v"] for _, f in await behind] == [b"a"]  # there already: answered at once
            ahead = asyncio.create_task(hub.xread(KEYS[0], first, 30_000))
            await _registered(hub, 1)
            await client.xadd(KEYS[0], {"v": "b"})
            assert [f[b"v"] for _, f in await ahead] == [b"b"]
            assert stream_id(b"12-3") == (12, 3) and stream_id("0-0") < stream_id(first)

    asyncio.run(main())


def test_a_stream_that_joins_during_a_read_is_not_kept_waiting_for_it(redis_server: EmbeddedRedis) -> None:
    """Its first read goes on its own while the hub's read (a minute long here) does not name it; a reader
    that comes back with a position is in the hub's next read, sent as soon as the one under way returns."""

    async def main() -> None:
        async with _hub(redis_server.url, block_ms=60_000) as (client, hub):
            waiting = asyncio.create_task(hub.xread(KEYS[0], "0-0", 120_000))
            await _registered(hub, 1)  # a read naming KEYS[0] alone is under way, for a minute
            joining = asyncio.create_task(hub.xread(KEYS[1], "0-0", 120_000))
            for _ in range(100):
                await asyncio.sleep(0)
            first = await client.xadd(KEYS[1], {"v": "new"})
            got = await asyncio.wait_for(joining, 30)  # its own read answered it, not the minute-long one
            assert [f[b"v"] for _, f in got] == [b"new"]
            assert not waiting.done()
            back = asyncio.create_task(hub.xread(KEYS[1], first, 120_000))  # not in the read under way: waits
            await client.xadd(KEYS[0], {"v": "old"})  # the read under way returns; the next names KEYS[1]
            assert [f[b"v"] for _, f in await waiting] == [b"old"]
            await client.xadd(KEYS[1], {"v": "next"})
            assert [f[b"v"] for _, f in await asyncio.wait_for(back, 30)] == [b"next"]

    asyncio.run(main())


def test_a_bound_passes_empty_and_a_redis_error_reaches_every_waiting_reader(redis_server: EmbeddedRedis) -> None:
    async def main() -> None:
        async with _hub(redis_server.url) as (_, hub):
            assert await hub.xread(KEYS[0], "0-0", 50) == []  # nothing came within the reader's bound
        async with _hub(redis_server.url) as (_, hub):
            reads = [asyncio.create_task(hub.xread(key, "0-0", 60_000)) for key in KEYS[:3]]
            await _registered(hub, 3)
            await asyncio.to_thread(redis.Redis.from_url(redis_server.url).client_kill_filter, _type="normal")
            outcomes = await asyncio.gather(*reads, return_exceptions=True)
            assert all(isinstance(o, redis.ConnectionError) for o in outcomes), outcomes

    asyncio.run(main())


def test_a_stream_read_through_the_hub_hands_each_event_on_once(redis_server: EmbeddedRedis) -> None:
    """Two readers of the same generation through one hub, the worker's redelivered attempt writing
    indexes 0-1 again: both get 0..3 once, then ``final``."""
    rid = "hub-gen"
    key = STREAM_KEY.format(id=rid)
    events = [StreamEvent(type="token", index=i, token_id=i, text=f"t{i}") for i in (0, 1, 0, 1, 2, 3)]
    events.append(StreamEvent(type="final", index=4, finish_reason="length"))

    async def main() -> None:
        async with _hub(redis_server.url) as (client, hub):
            async def read() -> list[tuple[str, int]]:
                out = []
                async for event in aiter_events(client, rid, timeout_s=60, read=hub.xread):
                    out.append((event.type, event.index))
                return out

            readers = [asyncio.create_task(read()) for _ in range(2)]
            await _registered(hub, 2)
            for event in events:
                await client.xadd(key, encode_event(event))
            got = await asyncio.gather(*readers)
            assert got == [[("token", 0), ("token", 1), ("token", 2), ("token", 3), ("final", 4)]] * 2

    asyncio.run(main())


@pytest.mark.parametrize("entry_id", ["0-0", b"1700000000000-7"])
def test_stream_ids_compare_as_numbers(entry_id: str | bytes) -> None:
    assert stream_id(entry_id) < stream_id("1700000000001-0")
    assert stream_id("9-10") > stream_id("9-9")  # not as text
