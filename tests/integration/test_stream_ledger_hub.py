"""The stream hub's ledger (:mod:`gateway.stream_hub`), on a real redis-server: a reader whose position is
before where the hub's read under way started in its stream — a second reader of a generation joining from
its start, a reader that fell behind the others — gets the entries after its own position, none skipped.

Before, such a reader joined the read under way and was handed that read's entries, which start after the
other reader's position: the entries in between were skipped. Its :class:`~producer.streams.StreamCursor`
then saw a token index jump, held back every later token and waited for the stored result: a late SSE
client of a running generation got nothing more until the generation ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio

from gateway.stream_hub import StreamHub
from producer.streams import aiter_events
from protocol.keys import STREAM_KEY
from protocol.streams import StreamEvent, encode_event
from tools.redis_server import EmbeddedRedis

KEY = "ledger-hub:0"


@contextlib.asynccontextmanager
async def _hub(url: str) -> AsyncIterator[tuple[redis.asyncio.Redis[bytes], StreamHub]]:
    """A hub whose reads block for a minute: a read under way stays under way until an entry comes."""
    client = redis.asyncio.Redis.from_url(url, max_connections=64)
    hub = StreamHub(client, block_ms=60_000)
    try:
        yield client, hub
    finally:
        await hub.aclose()
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


async def _waiters(hub: StreamHub, key: str, count: int) -> None:
    """Until ``count`` readers of ``key`` wait on the hub and its read is under way."""
    for _ in range(10_000):  # each pass yields to the loop: an event, not a time window
        if len(hub._waiting.get(key, ())) >= count and hub._reading:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never {count} readers of {key} in the hub's read")


def _values(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[str]:
    return [fields[b"v"].decode() for _, fields in entries]


def test_a_reader_behind_the_read_under_way_gets_its_own_entries(redis_server: EmbeddedRedis) -> None:
    async def main() -> None:
        async with _hub(redis_server.url) as (client, hub):
            ids = [await client.xadd(KEY, {"v": f"e{i}"}) for i in range(5)]
            ahead = asyncio.create_task(hub.xread(KEY, ids[-1], 120_000))
            await _waiters(hub, KEY, 1)  # the hub's read, from e4, is under way for a minute
            behind = asyncio.create_task(hub.xread(KEY, ids[1], 120_000))  # e2..e4 are there for it
            joining = asyncio.create_task(hub.xread(KEY, "0-0", 120_000))  # a second reader's first read
            await _waiters(hub, KEY, 3)
            await client.xadd(KEY, {"v": "e5"})  # the read under way returns
            assert _values(await asyncio.wait_for(ahead, 30)) == ["e5"]
            got_behind = _values(await asyncio.wait_for(behind, 30))
            got_joining = _values(await asyncio.wait_for(joining, 30))
            assert got_behind == ["e2", "e3", "e4", "e5"]  # old: ["e5"], e2..e4 skipped
            assert got_joining == ["e0", "e1", "e2", "e3", "e4", "e5"]  # old: ["e5"]

    asyncio.run(main())


def test_a_second_reader_of_a_running_generation_streams_every_token(redis_server: EmbeddedRedis) -> None:
    """Two relays of one generation through one hub, the second opened after the first handed on 3 tokens:
    the second hands on every token as the worker wrote it (its own text per token), not the rest of the
    stream in one piece from a stored result (there is none here: it would wait for ever)."""
    rid = "ledger-hub-gen"
    key = STREAM_KEY.format(id=rid)
    tokens = [StreamEvent(type="token", index=i, token_id=100 + i, text=f"<{i}>") for i in range(8)]
    end = StreamEvent(type="final", index=8, finish_reason="length")

    async def main() -> None:
        async with _hub(redis_server.url) as (client, hub):
            first: list[StreamEvent] = []
            second: list[StreamEvent] = []
            three = asyncio.Event()

            async def read(into: list[StreamEvent]) -> None:
                async for event in aiter_events(client, rid, timeout_s=60, read=hub.xread):
                    into.append(event)
                    if len(first) == 3:
                        three.set()

            reader = asyncio.create_task(read(first))
            for event in tokens[:3]:
                await client.xadd(key, encode_event(event))
            await three.wait()
            await _waiters(hub, key, 1)  # the first reader waits in the hub's read, from token 2
            late = asyncio.create_task(read(second))
            await _waiters(hub, key, 2)
            for event in [*tokens[3:], end]:
                await client.xadd(key, encode_event(event))
            await asyncio.wait_for(asyncio.gather(reader, late), 30)  # old: the late reader waited for ever
            expected = [(e.type, e.index, e.text) for e in [*tokens, end]]
            assert [(e.type, e.index, e.text) for e in first] == expected
            assert [(e.type, e.index, e.text) for e in second] == expected

    asyncio.run(main())
