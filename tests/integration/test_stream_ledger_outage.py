"""A stream reader never waits past its stated silence bound (``timeout_s``) while Redis does not answer, on a
real redis-server killed under it: it raises the Redis error once nothing arrived for ``timeout_s``.

Before, the reader tried again for ``max_outage_s`` whatever its ``timeout_s``: ``FleetClient.stream(rid,
timeout_s=2)`` raised after 30 s, and a reader with no outage bound never raised at all.
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer.streams import aiter_events, iter_events
from protocol.keys import STREAM_KEY
from protocol.streams import StreamEvent, encode_event
from tests.integration.ops_fixtures import wait_until
from tools.redis_server import EmbeddedRedis

HANG_GUARD_S = 120.0
"""How long the test waits for the reader to give up before it calls it hung (a guard, not a measure)."""


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_reader_gives_up_at_its_silence_bound_while_redis_is_down(face: str) -> None:
    rid = f"down-{face}"
    seen: list[StreamEvent] = []
    failure: list[BaseException] = []
    ended = threading.Event()
    with EmbeddedRedis() as server:
        writer = server.client()
        writer.xadd(STREAM_KEY.format(id=rid), encode_event(StreamEvent(type="token", index=0, token_id=1, text="a")))

        def read_sync() -> None:
            client: redis.Redis[bytes] = redis.Redis.from_url(server.url, retry=Retry(NoBackoff(), 0))
            try:  # no outage bound: only the silence bound can end the wait
                for event in iter_events(client, rid, timeout_s=1.0, block_ms=100, max_outage_s=math.inf):
                    seen.append(event)
            finally:
                client.close()

        async def read_async() -> None:
            client: redis.asyncio.Redis[bytes] = redis.asyncio.Redis.from_url(
                server.url, retry=AsyncRetry(NoBackoff(), 0))
            try:
                async for event in aiter_events(client, rid, timeout_s=1.0, block_ms=100, max_outage_s=math.inf):
                    seen.append(event)
            finally:
                await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose

        def read() -> None:
            try:
                read_sync() if face == "sync" else asyncio.run(read_async())
            except Exception as exc:  # what the reader raised: checked below
                failure.append(exc)
            finally:
                ended.set()

        threading.Thread(target=read, daemon=True).start()  # daemon: on the old code it never returns
        wait_until(lambda: seen or failure, 30, "the reader to hand on the first token")
        assert not failure, failure
        server.kill()
        assert ended.wait(HANG_GUARD_S), "the reader still waits for a Redis that does not answer, past its timeout_s"
        writer.close()
    assert [e.index for e in seen] == [0]
    assert len(failure) == 1 and isinstance(failure[0], redis.ConnectionError), failure
