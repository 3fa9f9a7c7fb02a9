"""A ``fleet dead-letter list`` page costs Redis what its entries do, not the whole list (real redis-server).

Before, every page read the whole list (up to 10,000 entries, ~5 MB here) to find its cursor; paging through
it read ~100 times that. Now a page reads one window from its cursor's place (``<id>@<place from the oldest>``):
one round trip, at most ``limit + 1 + SCAN_SLACK`` entries, whatever the list's length; the walk stays exact
while entries arrive at the head (trimming the oldest) and others are removed.
"""

from __future__ import annotations

import random
from typing import Any

import redis

from producer.deadletter import DeadLetterStore
from producer.deadletter_paging import SCAN_SLACK
from protocol.deadletter import MAX_ENTRIES, Reason, encode_entry, make_entry
from protocol.errors import InvalidRequest
from protocol.keys import DEAD_LETTER_KEY
from tests.queue_items import envelope, good_body, raw
from tools.redis_server import EmbeddedRedis

QUEUE = "fleet.demo-lm"
LIMIT = 100


class Counting(redis.Connection):
    """A connection that counts the commands it sends and the bytes of the replies it reads."""

    sent = 0
    reply_bytes = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        Counting.sent += 1
        super().send_packed_command(command, check_health)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = super().read_response(*args, **kwargs)
        Counting.reply_bytes += _size(reply)
        return reply


def _size(reply: Any) -> int:
    if isinstance(reply, bytes | str):
        return len(reply)
    if isinstance(reply, list):
        return sum(_size(r) for r in reply)
    return 8


def _item(i: int) -> bytes:
    return encode_entry(make_entry(raw(envelope(QUEUE, good_body({"model": "demo-lm", "input_ids": [i]}),
                                                task_id=f"t-{i}")), reason=Reason.MAX_DELIVERIES,
                                   detail="delivered 3 times without an ack", field="deliveries", queue=QUEUE,
                                   list_key=QUEUE, now_unix_s=0.0, task_id=f"t-{i}"))  # fmt: skip


def _fill(r: redis.Redis[bytes], start: int, n: int, tasks: dict[bytes, str] | None = None) -> int:
    """Push entries t-start .. t-(start+n-1) as a worker does (LPUSH, LTRIM); the longest item's bytes.
    ``tasks`` gets each item's task ID."""
    items = [_item(i) for i in range(start, start + n)]
    with r.pipeline(transaction=False) as pipe:
        for item in items:
            pipe.lpush(DEAD_LETTER_KEY, item)
            pipe.ltrim(DEAD_LETTER_KEY, 0, MAX_ENTRIES - 1)
        pipe.execute()
    if tasks is not None:
        tasks.update((item, f"t-{i}") for i, item in zip(range(start, start + n), items, strict=True))
    return max(len(i) for i in items)


def _store(url: str) -> DeadLetterStore:
    pool = redis.ConnectionPool.from_url(url, connection_class=Counting)
    store = DeadLetterStore(redis.Redis(connection_pool=pool))
    store.count()  # the connection's handshake (HELLO, CLIENT SETINFO) is not a page's cost
    return store


def _page_costs(store: DeadLetterStore, after: str | None) -> tuple[Any, int, int]:
    sent, got = Counting.sent, Counting.reply_bytes
    page = store.page(limit=LIMIT, after=after)
    return page, Counting.sent - sent, Counting.reply_bytes - got


def test_a_page_reads_one_window_whatever_the_list_length(redis_server: EmbeddedRedis) -> None:
    """Old code: each page read every entry (10,000 x ~500 bytes); the 100-page walk read ~500 MB."""
    r = redis.Redis.from_url(redis_server.url)
    longest = _fill(r, 0, 1_000)
    store = _store(redis_server.url)
    _, _, bytes_short = _page_costs(store, store.page(limit=LIMIT).next_cursor)
    longest = max(longest, _fill(r, 1_000, MAX_ENTRIES - 1_000))
    bound = (LIMIT + 1 + SCAN_SLACK) * longest + 64
    seen: list[str | None] = []
    after = None
    while True:
        page, trips, got = _page_costs(store, after)
        assert trips == 1 and got <= bound, (len(seen), trips, got, bound)
        seen += [e.task_id for e in page.entries]
        after = page.next_cursor
        if after is None:
            break
    assert seen == [f"t-{i}" for i in reversed(range(MAX_ENTRIES))]
    _, _, bytes_long = _page_costs(store, store.page(limit=LIMIT).next_cursor)
    assert abs(bytes_long - bytes_short) <= 2 * longest, (bytes_short, bytes_long)  # 1,000 or 10,000: same cost


def test_the_walk_stays_exact_while_entries_arrive_and_leave(redis_server: EmbeddedRedis) -> None:
    """Between pages: 5 entries arrive (the first time, trimming the 5 oldest of the full list), 3 not shown yet
    and 2 shown are removed. Each entry still there when its turn comes is shown once, in order; one round trip a
    page."""
    r = redis.Redis.from_url(redis_server.url)
    tasks: dict[bytes, str] = {}
    _fill(r, 0, MAX_ENTRIES, tasks)
    original = [f"t-{i}" for i in reversed(range(MAX_ENTRIES))]
    store = _store(redis_server.url)
    rng = random.Random(7)
    removed_unseen: set[str] = set()
    seen: list[str] = []
    after, arrived = None, 0
    while True:
        page, trips, _ = _page_costs(store, after)
        assert trips == 1, (len(seen), trips)
        seen += [str(e.task_id) for e in page.entries]
        after = page.next_cursor
        if after is None:
            break
        _fill(r, MAX_ENTRIES + arrived, 5, tasks)
        arrived += 5
        on_list = [(item, tasks[item]) for item in r.lrange(DEAD_LETTER_KEY, 0, -1)]
        at = [t for _, t in on_list].index(seen[-1])
        unseen = on_list[at + 1:]
        shown = [(item, t) for item, t in on_list[:at + 1] if int(t[2:]) < MAX_ENTRIES]
        for item, task in rng.sample(unseen, min(3, len(unseen))):
            assert r.lrem(DEAD_LETTER_KEY, 1, item) == 1
            removed_unseen.add(task)
        for item, _ in rng.sample(shown, min(2, len(shown))):
            assert r.lrem(DEAD_LETTER_KEY, 1, item) == 1
    on_list_at_end = {tasks[item] for item in r.lrange(DEAD_LETTER_KEY, 0, -1)}
    trimmed = {t for t in original if t not in on_list_at_end and t not in seen and t not in removed_unseen}
    assert len(trimmed) <= 5 and removed_unseen, (len(trimmed), len(removed_unseen))
    assert seen == [t for t in original if t not in removed_unseen and t not in trimmed]


def test_a_cursor_whose_entry_moved_past_the_window_is_still_found(redis_server: EmbeddedRedis) -> None:
    """500 entries older than the cursor go (a purge of the oldest): the scan goes on towards the tail, a few
    windows more, and the next page is still the one after the cursor; a cursor whose own entry went is refused."""
    r = redis.Redis.from_url(redis_server.url)
    tasks: dict[bytes, str] = {}
    _fill(r, 0, 2_000, tasks)
    store = _store(redis_server.url)
    first = store.page(limit=LIMIT)
    r.ltrim(DEAD_LETTER_KEY, 0, 1_499)  # the 500 oldest go
    page, trips, _ = _page_costs(store, first.next_cursor)
    assert [e.task_id for e in page.entries] == [f"t-{i}" for i in range(1_899, 1_799, -1)]
    assert 1 < trips <= 500 // (LIMIT + 1 + SCAN_SLACK) + 2, trips
    r.lrem(DEAD_LETTER_KEY, 1, r.lindex(DEAD_LETTER_KEY, LIMIT - 1) or b"")  # the cursor's own entry
    try:
        store.page(limit=LIMIT, after=first.next_cursor)
    except InvalidRequest as exc:
        assert exc.field == "after" and "list again without --after" in exc.message
    else:
        raise AssertionError("a cursor whose entry is gone was not refused")
