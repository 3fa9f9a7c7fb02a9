"""``broker.atomic_take``'s script on a real redis-server: it records each message as kombu does before it
trims it off the list, takes nothing when Redis refuses the writes, and takes a tagless item unrecorded;
the wait (``BLMOVE`` onto the same list) leaves the list as it was."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from kombu.entity import Queue
from kombu.messaging import Consumer
from kombu.transport import redis as kombu_redis
from redis._parsers.base import BaseParser

from broker.atomic_take import CANCEL_PREFIX, RETAG, TAKE_SCRIPT, TAKEN_PREFIX, sections
from broker.batch_take import unacked_entry_of
from broker.poison import GuardedChannel
from tests.integration import take_victim
from tests.integration.fleet_fixtures import Fleet
from tests.queue_items import shared_tag_generations
from tools.redis_server import EmbeddedRedis

QUEUE = "fleet.demo-lm"
KEYS = [QUEUE, QUEUE + "\x06\x163", "unacked", "unacked_index"]


def _envelope(n: int) -> bytes:
    info = {"exchange": "", "routing_key": QUEUE}
    return json.dumps({"body": "W10=", "headers": {"id": f"id-{n}", "task": "fleet.infer"},
                       "properties": {"delivery_tag": f"tag-{n}", "delivery_info": info}}).encode()


def _take(r: redis.Redis[bytes], most: int, *storing: str) -> list[bytes | int | None]:
    reply: list[bytes | int | None] = r.eval(  # type: ignore[no-untyped-call]
        TAKE_SCRIPT, len(KEYS), *KEYS, most, "1000.5", CANCEL_PREFIX, TAKEN_PREFIX, 600, *storing)
    return reply


def test_the_script_records_the_oldest_messages_before_it_trims_them(redis_server: EmbeddedRedis) -> None:
    r = redis_server.client()
    for n in range(5):
        r.lpush(QUEUE, _envelope(n))  # LPUSH as kombu's producers: the oldest is at the right end
    r.lpush(KEYS[1], _envelope(9))  # a later list in kombu's order: reached only with room left
    r.set(CANCEL_PREFIX + "id-1", 1)
    assert r.blmove(QUEUE, QUEUE, 1, "RIGHT", "RIGHT") == _envelope(0)  # the wait pops nothing
    assert r.lrange(QUEUE, 0, -1) == [_envelope(n) for n in (4, 3, 2, 1, 0)]

    reply = _take(r, 3)
    assert [(key, err) for key, err, _ in sections(reply)] == [(QUEUE, None)]
    rows = [reply[k : k + 4] for k in range(3, len(reply), 4)]
    assert rows == [[_envelope(n), f"tag-{n}".encode(), f"id-{n}".encode(), int(n == 1)] for n in (0, 1, 2)]
    for n in (0, 1, 2):  # kombu's own entry: what its restore reads back
        raw = _envelope(n)
        entry = r.hget("unacked", f"tag-{n}")
        assert entry is not None and entry.startswith(b"[" + raw + b",")  # the list's bytes, spliced in
        assert json.loads(entry) == json.loads(unacked_entry_of(raw, QUEUE))
        assert r.zscore("unacked_index", f"tag-{n}") == 1000.5
    # a request taken without a cancel mark is noted as taken (a later cancel is asked of this worker); the
    # marked one is not (its cancel was for good: protocol.cancel_marks)
    assert [r.ttl(TAKEN_PREFIX + f"id-{n}") for n in (0, 1, 2)] == [600, -2, 600]
    assert r.lrange(QUEUE, 0, -1) == [_envelope(4), _envelope(3)]

    taken = sections(_take(r, 8))  # room for more than the first list holds: the next list too, in order
    assert [(key, [row for row in rows[::4]]) for key, _, rows in taken] == [
        (QUEUE, [_envelope(3), _envelope(4)]), (KEYS[1], [_envelope(9)])]
    assert not r.exists(QUEUE) and not r.exists(KEYS[1])
    assert r.hlen("unacked") == 6
    assert _take(r, 8) is None  # every list empty


@pytest.mark.parametrize("info", [{"exchange": "", "routing_key": "fleet.nowhere"},  # a queue nobody consumes
                                  {"exchange": "bogus", "routing_key": QUEUE},  # kombu looks it up to nothing
                                  {"exchange": "", "routing_key": ""}])
def test_a_taken_message_is_restored_onto_the_queue_it_came_from_whatever_its_envelope_says(
    redis_server: EmbeddedRedis, info: dict[str, str]
) -> None:
    """kombu restores a dead worker's message by the routing of its unacked entry; the entry named the
    envelope's routing, so a sender's stray ``delivery_info`` stranded the message on a list nobody reads,
    or restored it nowhere (a lost request). The entry now names the list it was taken from (its queue,
    for a priority's list) on the default exchange, which kombu's restore reads as that queue."""
    r = redis_server.client()
    for n, key in ((0, KEYS[0]), (1, KEYS[1])):
        r.lpush(key, json.dumps({"body": "W10=", "headers": {"id": f"id-{n}", "task": "fleet.infer"},
                                 "properties": {"delivery_tag": f"tag-{n}", "delivery_info": info}}).encode())
    assert len(sections(_take(r, 4))) == 2
    for n in (0, 1):
        entry = json.loads(r.hget("unacked", f"tag-{n}") or b"null")
        assert entry[1:] == ["", QUEUE]  # the priority list's too: kombu picks the list by its priority
        channel = object.__new__(kombu_redis.Channel)
        channel.deadletter_queue = None
        assert channel._lookup(entry[1], entry[2]) == [QUEUE]  # kombu's restore target for that entry


def test_messages_that_share_a_delivery_tag_each_keep_an_unacked_entry(redis_server: EmbeddedRedis) -> None:
    """kombu's unacked hash holds one entry per tag: a sender that reused a tag had the later message overwrite
    the earlier's entry, and a worker killed while it held them gave back only one (the others were in no
    list and no hash). A tag held already gets a suffix of its own; the list's bytes are recorded as taken."""
    r = redis_server.client()
    shared = {"exchange": "", "routing_key": QUEUE}
    items = [json.dumps({"body": "W10=", "headers": {"id": f"id-{n}", "task": "fleet.infer"},
                         "properties": {"delivery_tag": "same", "delivery_info": shared}}).encode() for n in range(3)]
    r.hset("unacked", "same", b"[held by a message taken earlier]")
    for item in items:
        r.lpush(QUEUE, item)
    [(_, _, rows)] = sections(_take(r, 3))
    tags = [row.decode() for row in rows[1::4]]
    assert len(set(tags)) == 3 and all(t.startswith("same" + RETAG) for t in tags), tags
    assert r.hget("unacked", "same") == b"[held by a message taken earlier]"  # not overwritten
    assert [json.loads(r.hget("unacked", t) or b"null")[0]["headers"]["id"] for t in tags] == ["id-0", "id-1", "id-2"]


def test_a_burst_split_between_lists_is_taken_in_one_run_up_to_the_free_tokens(redis_server: EmbeddedRedis) -> None:
    """Prefix-aware routing splits a burst between the worker's own queue and the model's: one run of the
    script takes from both (old script: the first list only, and the next turn waited on the emptied one)."""
    r = redis_server.client()
    for n in range(4):
        r.lpush(QUEUE, _envelope(n))
    for n in range(10, 16):
        r.lpush(KEYS[1], _envelope(n))
    taken = sections(_take(r, 7))
    assert [(key, len(rows) // 4) for key, _, rows in taken] == [(QUEUE, 4), (KEYS[1], 3)]
    assert [row for _, _, rows in taken for row in rows[::4]] == [_envelope(n) for n in (0, 1, 2, 3, 10, 11, 12)]
    assert r.lrange(KEYS[1], 0, -1) == [_envelope(15), _envelope(14), _envelope(13)]  # beyond the tokens: queued
    assert sorted(r.hkeys("unacked")) == sorted(f"tag-{n}".encode() for n in (0, 1, 2, 3, 10, 11, 12))


def test_refused_writes_take_nothing_and_a_tagless_item_is_taken_unrecorded(redis_server: EmbeddedRedis) -> None:
    r = redis_server.client()
    r.lpush(QUEUE, _envelope(0), b"not a kombu envelope", _envelope(2))
    r.config_set("min-replicas-to-write", 1)  # NOREPLICAS for every write, as MISCONF or OOM would
    try:
        reply = _take(r, 3)
    finally:
        r.config_set("min-replicas-to-write", 0)
    assert reply[0] == QUEUE.encode() and str(reply[1]).find("NOREPLICAS") >= 0 and reply[2:] == [0], reply
    assert r.llen(QUEUE) == 3 and r.hlen("unacked") == 0  # nothing taken, nothing recorded

    reply = _take(r, 3)
    assert reply[2:] == [3, _envelope(0), b"tag-0", b"id-0", 0, b"not a kombu envelope", None, None, None,
                         _envelope(2), b"tag-2", b"id-2", 0]
    assert sorted(r.hkeys("unacked")) == [b"tag-0", b"tag-2"] and r.llen(QUEUE) == 0


@pytest.fixture
def guard_undone_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """poison.install changes process-wide state (kombu's channel classes, redis-py's error classes), as a
    worker process does; this test runs in pytest's process, so every one is put back after it."""
    monkeypatch.setattr(kombu_redis.Transport, "Channel", kombu_redis.Transport.Channel)
    monkeypatch.setattr(kombu_redis.SentinelTransport, "Channel", kombu_redis.SentinelTransport.Channel)
    monkeypatch.setattr(BaseParser, "EXCEPTION_CLASSES", dict(BaseParser.EXCEPTION_CLASSES))


@pytest.mark.usefixtures("guard_undone_after")
def test_a_closing_channel_reads_its_pending_wait_and_takes_nothing(redis_server: EmbeddedRedis) -> None:
    """kombu reads a pending reply when a channel closes (a popped message must not vanish); the wait
    popped nothing, so a message that arrived meanwhile stays queued, unrecorded, for the next worker."""
    app = take_victim._app(redis_server.url)
    r = redis_server.client()
    delivered: list[Any] = []
    with app.connection_for_read() as conn:
        consumer = Consumer(conn, queues=[Queue(QUEUE)], callbacks=[lambda body, message: delivered.append(body)],  # type: ignore[no-untyped-call]
                            accept=["json"], prefetch_count=4)
        consumer.consume()  # type: ignore[no-untyped-call]
        channel = consumer.channel
        conn.transport.cycle.on_poll_start()  # what the event loop does: sends the wait
        assert isinstance(channel, GuardedChannel) and channel.take_atomic and channel.peek_sent
        r.lpush(QUEUE, _envelope(0))
        channel.close()  # type: ignore[no-untyped-call]
    assert delivered == [] and r.lrange(QUEUE, 0, -1) == [_envelope(0)] and r.hlen("unacked") == 0
    app.close()


def test_a_delivery_whose_result_is_written_frees_its_token_before_its_thread_notes_it(
    redis_server: EmbeddedRedis,
) -> None:
    """A caller can have a result (and queue more) before the worker's storing thread has noted the ack:
    the take counts a storing delivery's token free once Redis no longer holds its unacked entry, never
    before (the unacked deliveries stay within the tokens)."""
    r = redis_server.client()
    r.hset("unacked", "still-held", "[]")  # its store script has not run yet
    for n in range(5):
        r.lpush(QUEUE, _envelope(n))
    taken = sections(_take(r, 2, "written", "still-held"))  # 2 free tokens, plus "written"'s
    assert [len(rows) // 4 for _, _, rows in taken] == [3]


def test_a_worker_killed_holding_messages_that_share_a_tag_gives_each_back(fleet: Fleet) -> None:
    """Three generations a sender queued under one delivery tag, running on a worker that is then SIGKILLed:
    each has its own unacked entry to be restored from (before: one entry, the other two lost for good)."""
    cfg = fleet.config(models={"demo-lm": {"limits": {"max_new_tokens": 480}}})
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    ids = [f"shared-tag-{n}" for n in range(3)]
    r.lpush(QUEUE, *shared_tag_generations(QUEUE, ids))
    for rid in ids:  # every one is running (a first token out of 480): held, unacked
        assert next(iter(client.stream(rid, timeout_s=60))).type == "token"
    worker.kill()
    held = [json.loads(entry)[0]["headers"]["id"] for entry in r.hvals("unacked")]
    assert sorted(held) == ids, held
