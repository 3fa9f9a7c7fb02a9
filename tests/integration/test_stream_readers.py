"""producer.streams against a real redis-server: XREAD BLOCK from the start, replays dropped, the end, silence,
and streams that stop short (a Redis restart, a gap, no entries at all) ending from the stored result.

A writer appends events the way a worker does (``XADD`` of :func:`protocol.streams.encode_event`),
from a thread for the sync reader and from a task on the reader's own loop for the async one.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer.client import FleetClient
from producer.streams import aiter_events, iter_events
from protocol.errors import FleetError, ResultTimeout
from protocol.keys import STREAM_KEY
from protocol.messages import InferenceResult, Usage
from protocol.settings import FleetSettings
from protocol.streams import StreamEvent, encode_event
from tests.integration.ops_fixtures import wait_until
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
    # how long the silence lasts is StreamCursor's arithmetic, checked on a fake clock (tests/unit/
    # test_stream_cursor.py); here the real reader ends in ResultTimeout naming that limit
    with pytest.raises(ResultTimeout, match="after token 1") as info:
        seen.extend(iter_events(client, "t1", timeout_s=0.3, block_ms=100))
    assert len(seen) == 2 and info.value.limit == 0.3 and info.value.field == "timeout_s", (seen, info.value)

    async def read_nothing() -> None:
        aredis: redis.asyncio.Redis[bytes] = redis.asyncio.Redis.from_url(server.url)
        try:
            async for _ in aiter_events(aredis, "never", timeout_s=0.3, block_ms=100):
                pytest.fail("the stream has no entries")
        finally:
            await aredis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose

    with pytest.raises(ResultTimeout, match="no event in the stream of never"):
        asyncio.run(read_nothing())


# -- streams that stop short: the stored result ends them ------------------------------------------
TEXTS = ["He", "ll", "", "o ", "wo", "rld", ""]  # token 2 completes no character; token 6 is EOS


def _stored_meta(rid: str, text: str = "Hello world!") -> bytes:
    """A SUCCESS as a worker stores it (Celery's JSON meta) for a 7-token generation showing ``text``."""
    n = len(TEXTS)
    result = {
        "request_id": rid, "model": "demo-lm", "version": "1.0.0", "kind": "generate", "input_tokens": 3,
        "generation": {
            "token_ids": [100 + i for i in range(n)], "text": text, "finish_reason": "stop",
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
            "timings": {"time_to_first_token_ms": 1.0, "mean_inter_token_ms": 1.0, "decode_steps": n,
                        "batch_size_min": 1, "batch_size_mean": 1.0, "batch_size_max": 1},
        },
        "timings": {"queue_wait_ms": 0.0, "batch_wait_ms": 0.0, "inference_ms": 1.0, "batch_size": 1,
                    "padded_tokens": 3, "worker": "w1@test"},
    }
    meta: dict[str, Any] = {"status": "SUCCESS", "result": result, "traceback": None, "children": [], "date_done": None,
            "task_id": rid}
    return json.dumps(meta).encode()


def _token(i: int) -> StreamEvent:
    return StreamEvent(type="token", index=i, token_id=100 + i, text=TEXTS[i])


def _fleet_client(server: EmbeddedRedis) -> FleetClient:
    return FleetClient(FleetSettings(redis_url=server.url, models={}))


def test_client_stream_cut_by_a_redis_restart_ends_from_the_stored_result() -> None:
    """Redis dies after 3 tokens and comes back empty (no persistence): the stream's key is gone and no
    event of it will be written again. The reader rides out the outage, then finishes from the result
    stored after the restart: same token indexes, same text, nothing twice."""
    with EmbeddedRedis() as server:
        writer = server.client()
        client = _fleet_client(server)
        try:
            for i in range(3):
                writer.xadd(STREAM_KEY.format(id="cut"), encode_event(_token(i)))
            seen: list[StreamEvent] = []
            failure: list[BaseException] = []

            def read() -> None:
                try:
                    seen.extend(client.stream("cut", timeout_s=20))
                except Exception as exc:  # reported below: the stream did not end
                    failure.append(exc)

            reader = threading.Thread(target=read)
            reader.start()
            wait_until(lambda: len(seen) == 3, 10, "the reader to hand on the first 3 tokens")
            server.kill()
            time.sleep(0.5)  # the outage's length
            server.start()
            writer.set(client.app.backend.get_key_for_task("cut"), _stored_meta("cut"))
            reader.join(30)
        finally:
            client.close()
            writer.close()
    assert not failure, failure
    assert [e.index for e in seen if e.type == "token"] == list(range(len(TEXTS)))
    assert "".join(e.text for e in seen) == "Hello world!" and seen[-1].type == "final"
    assert seen[-1].finish_reason == "stop" and seen[-1].usage is not None and seen[-1].usage.completion_tokens == 7


def test_a_gap_in_the_stream_is_filled_from_the_stored_result(
    server: EmbeddedRedis, client: redis.Redis[bytes]
) -> None:
    """Tokens 2 and 3 never reached the stream (written to a Redis that then lost them), the rest did:
    the reader does not hand on 4 after 1; it finishes from the stored result instead."""
    usage = Usage(prompt_tokens=3, completion_tokens=7, total_tokens=10)
    end = StreamEvent(type="final", index=7, finish_reason="stop", usage=usage, text="!")
    _write(client, "gap", [_token(0), _token(1), _token(4), _token(5), _token(6), end], 0)
    fleet = _fleet_client(server)
    try:
        client.set(fleet.app.backend.get_key_for_task("gap"), _stored_meta("gap"))
        got = list(fleet.stream("gap", timeout_s=10))
    finally:
        fleet.close()
    assert [e.index for e in got if e.type == "token"] == list(range(7))
    assert "".join(e.text for e in got) == "Hello world!" and got[-1].type == "final"


def test_a_stream_whose_events_were_never_written_ends_from_the_result(
    server: EmbeddedRedis, client: redis.Redis[bytes]
) -> None:
    """No stream key at all (the worker's events were lost), the result stored: the reader ends from it
    instead of waiting out its silence."""
    fleet = _fleet_client(server)
    try:
        client.set(fleet.app.backend.get_key_for_task("nostream"), _stored_meta("nostream"))
        got = list(fleet.stream("nostream", timeout_s=15))  # ResultTimeout if it waited for the events
    finally:
        fleet.close()
    assert "".join(e.text for e in got) == "Hello world!" and [e.type for e in got][-1] == "final"


def test_the_async_reader_ends_from_the_stored_result_too(server: EmbeddedRedis, client: redis.Redis[bytes]) -> None:
    _write(client, "agap", [_token(0), _token(3)], 0)
    fleet = _fleet_client(server)

    async def read() -> list[StreamEvent]:
        aredis: redis.asyncio.Redis[bytes] = redis.asyncio.Redis.from_url(server.url)

        async def outcome() -> InferenceResult | FleetError | None:
            raw = await aredis.get(fleet.app.backend.get_key_for_task("agap"))
            return None if raw is None else fleet.outcome_of("agap", fleet.app.backend.decode_result(raw))

        try:
            return [e async for e in aiter_events(aredis, "agap", timeout_s=10, block_ms=100, outcome=outcome)]
        finally:
            await aredis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose

    try:
        client.set(fleet.app.backend.get_key_for_task("agap"), _stored_meta("agap"))
        got = asyncio.run(read())
    finally:
        fleet.close()
    assert [e.index for e in got if e.type == "token"] == list(range(7))
    assert "".join(e.text for e in got) == "Hello world!"


def _no_retry_client(server: EmbeddedRedis) -> redis.Redis[bytes]:
    """A client without redis-py's own retries: what the reader itself does while Redis is down shows."""
    return redis.Redis.from_url(server.url, retry=Retry(NoBackoff(), 0))


def test_reader_reconnects_while_redis_restarts_and_reads_on() -> None:
    with EmbeddedRedis() as server:
        writer, reader_client = server.client(), _no_retry_client(server)
        seen: list[StreamEvent] = []
        failure: list[BaseException] = []

        def read() -> None:
            try:
                seen.extend(iter_events(reader_client, "rc", timeout_s=20, block_ms=100))
            except Exception as exc:  # reported below
                failure.append(exc)

        try:
            writer.xadd(STREAM_KEY.format(id="rc"), encode_event(_token(0)))
            thread = threading.Thread(target=read)
            thread.start()
            wait_until(lambda: len(seen) == 1, 10, "the first token")
            server.kill()
            time.sleep(0.3)  # the outage's length
            server.start()
            for i in range(1, len(TEXTS)):
                writer.xadd(STREAM_KEY.format(id="rc"), encode_event(_token(i)))
            usage = Usage(prompt_tokens=3, completion_tokens=7, total_tokens=10)
            writer.xadd(STREAM_KEY.format(id="rc"), encode_event(
                StreamEvent(type="final", index=7, finish_reason="stop", usage=usage, text="!")))
            thread.join(30)
        finally:
            writer.close()
            reader_client.close()
    assert not failure, failure
    assert "".join(e.text for e in seen) == "Hello world!" and [e.index for e in seen][:-1] == list(range(7))


def test_reader_gives_up_once_redis_stayed_down_past_its_bound() -> None:
    with EmbeddedRedis() as server:
        reader_client = _no_retry_client(server)
        server.kill()
        try:
            with pytest.raises(redis.ConnectionError):
                list(iter_events(reader_client, "down", timeout_s=600, block_ms=100, max_outage_s=1.0))
        finally:
            reader_client.close()
