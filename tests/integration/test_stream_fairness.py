"""Readers of one stream through the gateway's hub (:mod:`gateway.stream_hub`) progress each at its own pace,
on a real redis-server: a reader far behind the others (more than ``READ_COUNT`` entries) catches up on its own
reads, and the readers already up to date get each new entry from the hub's first read.

Before, the hub's read started at the position of the reader furthest behind: with a backlog of four reads
(4 x ``READ_COUNT`` entries), each read returned the other's old entries only, and the up-to-date reader got
its one new entry from the hub's ninth read, after the other's catch-up.
"""

from __future__ import annotations

import asyncio

import redis.asyncio

from producer.streams import READ_COUNT, Entry
from tests.integration.test_stream_ledger_hub import _hub, _waiters  # a hub whose reads block for a minute
from tools.redis_server import EmbeddedRedis

KEY = "fair-hub:0"
BACKLOG = 4 * READ_COUNT
"""Entries the reader behind has to read before the new one: four reads' worth."""


async def _fill(client: redis.asyncio.Redis[bytes], key: str, count: int) -> list[bytes]:
    """``count`` entries ``v=0 … count-1`` in ``key``; their IDs."""
    async with client.pipeline(transaction=False) as pipe:
        for i in range(count):
            pipe.xadd(key, {"v": str(i)})
        return list(await pipe.execute())


def _values(entries: list[Entry]) -> list[int]:
    return [int(fields[b"v"]) for _, fields in entries]


def test_a_reader_far_behind_does_not_delay_the_reader_up_to_date(redis_server: EmbeddedRedis) -> None:
    async def main() -> None:
        async with _hub(redis_server.url) as (client, hub):
            ids = await _fill(client, KEY, BACKLOG + 1)  # the last one is new to the reader up to date
            reads_when_answered: list[int] = []

            async def up_to_date() -> list[Entry]:
                got = await hub.xread(KEY, ids[-2], 120_000)
                reads_when_answered.append(hub.reads)
                return got

            async def behind() -> list[int]:
                seen: list[int] = []
                last: bytes | str = "0-0"
                while len(seen) < BACKLOG + 1:
                    got = await hub.xread(KEY, last, 120_000)
                    seen += _values(got)
                    last = got[-1][0]
                return seen

            # both wait on the hub before its first read: it starts from where they stand
            ahead_task, behind_task = asyncio.create_task(up_to_date()), asyncio.create_task(behind())
            got_ahead, got_behind = await asyncio.wait_for(asyncio.gather(ahead_task, behind_task), 60)
            assert _values(got_ahead) == [BACKLOG]
            assert reads_when_answered == [1]  # old: [9], after the reads of the other's backlog
            assert got_behind == list(range(BACKLOG + 1))  # each entry once, in order
            assert hub.behind_reads >= 1  # its first read went on its own, beside the hub's (alone, it is the head)

            # caught up, both share the hub's read again: one read answers both
            reads_before, behind_reads_before = hub.reads, hub.behind_reads
            both = [asyncio.create_task(hub.xread(KEY, ids[-1], 120_000)) for _ in range(2)]
            await _waiters(hub, KEY, 2)
            await client.xadd(KEY, {"v": str(BACKLOG + 1)})
            assert [_values(got) for got in await asyncio.wait_for(asyncio.gather(*both), 30)] == [[BACKLOG + 1]] * 2
            assert hub.reads == reads_before + 1 and hub.behind_reads == behind_reads_before

    asyncio.run(main())

