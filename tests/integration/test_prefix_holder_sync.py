"""A conversation is held before its reply is out: ``PrefixHolder.sync`` waits for the digests enqueued before
it, and the stream publisher's last event of a stream waits for it (real redis-server, Redis's MONITOR).

The holder writes from a thread of its own; before, a generation's result and its stream's last event could
reach Redis before the digests of its history, and the caller's next turn, sent at once, found no holder
(unrouted, and a prefix-cache miss on whichever worker took it). The holder's writes are stalled here by a
gate in front of its pipeline: what must wait for them, waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import redis

from protocol.keys import PREFIX_HOLDER_KEY, STREAM_KEY
from protocol.messages import Usage
from protocol.streams import StreamEvent
from tests.integration.redis_monitor import Monitor
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis
from workers.direct_queue import PrefixHolder
from workers.stream_publisher import StreamPublisher

DIGEST = b"\x01" * 8


class _Gate:
    """A Redis client whose pipelines stop at ``execute`` until ``opened`` is set: the holder's writes stall."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.client = client
        self.reached = threading.Event()
        self.opened = threading.Event()

    def pipeline(self, transaction: bool = True) -> Any:
        pipe = self.client.pipeline(transaction=transaction)
        execute: Callable[..., Any] = pipe.execute

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.reached.set()
            assert self.opened.wait(60), "the test never opened the gate"
            return execute(*args, **kwargs)

        pipe.execute = gated  # type: ignore[method-assign]
        return pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


@pytest.fixture
def gated(redis_server: EmbeddedRedis) -> Iterator[tuple[PrefixHolder, _Gate]]:
    gate = _Gate(redis.Redis(port=redis_server.port))
    holder = PrefixHolder(cast("redis.Redis[bytes]", gate), model="m", hostname="h", ttl_s=60)
    holder.start()
    try:
        yield holder, gate
    finally:
        gate.opened.set()
        holder.stop()


def _held(server: EmbeddedRedis) -> bool:
    return bool(redis.Redis(port=server.port).sismember(PREFIX_HOLDER_KEY.format(model="m", host="h"), DIGEST))


def test_sync_returns_once_what_was_enqueued_before_it_is_in_redis(
    gated: tuple[PrefixHolder, _Gate], redis_server: EmbeddedRedis
) -> None:
    holder, gate = gated
    holder.held([DIGEST])
    assert gate.reached.wait(10)
    assert holder.sync(timeout_s=0.2) is False  # the write is stalled: the bounded wait runs out, and says so
    assert not _held(redis_server)
    gate.opened.set()
    assert holder.sync() is True
    assert _held(redis_server)  # at once, not eventually


def test_sync_does_not_wait_on_a_holder_that_does_not_run() -> None:
    holder = PrefixHolder(cast("redis.Redis[bytes]", None), model="m", hostname="h", ttl_s=60)
    holder.held([DIGEST])
    assert holder.sync(timeout_s=60) is False  # returns at once: nothing would ever write it


def test_a_stream_s_last_event_is_written_after_the_digests(
    gated: tuple[PrefixHolder, _Gate], redis_server: EmbeddedRedis
) -> None:
    holder, gate = gated
    holder.held([DIGEST])  # the scheduler offers the history to the prefix cache before the sequence ends
    assert gate.reached.wait(10)
    publisher = StreamPublisher(redis.Redis(port=redis_server.port), ttl_s=60)
    waiting = threading.Event()

    def before_end() -> bool:
        waiting.set()
        return holder.sync(timeout_s=60)

    publisher.before_end = before_end
    monitor = Monitor(redis_server.url)
    key = STREAM_KEY.format(id="r")
    for i in range(3):
        publisher.publish("r", StreamEvent(type="token", index=i, token_id=10 + i, text="x"))
    publisher.publish("r", StreamEvent(type="final", index=3, finish_reason="length",
                                       usage=Usage(prompt_tokens=1, completion_tokens=3, total_tokens=4)))  # fmt: skip
    publisher.start()
    try:
        # the publisher waits for the holder, or (before) wrote the stream while the digests were stalled
        poll_until(lambda: waiting.is_set() or redis.Redis(port=redis_server.port).xlen(key), 30,
                   "the publisher to reach the stream's end")  # fmt: skip
        gate.opened.set()
        poll_until(lambda: publisher.published == 4, 30, "the stream's events to be written")
        commands = [c["command"] for c in monitor.up_to_now()]
    finally:
        publisher.stop()
        monitor.close()
    sadd = next(i for i, c in enumerate(commands) if c.startswith("SADD "))
    ends = [i for i, c in enumerate(commands) if c.startswith(f"XADD {key} ") and '"final"' in c]
    assert ends and all(sadd < i for i in ends), commands
