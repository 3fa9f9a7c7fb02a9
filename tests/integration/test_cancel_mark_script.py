"""The cancel mark's script (``protocol.cancel_marks.MARK_SCRIPT``) on a real redis-server: for good where no
worker noted a take, asked of the holder where one did, and a cancel for good stays one."""

from __future__ import annotations

import json

import redis

from protocol.cancel_marks import FOR_GOOD, HELD, MARK_SCRIPT, cancelled_for_good, mark_args, mark_keys
from protocol.keys import CANCEL_CHANNEL, CANCEL_KEY, RESULT_KEY, TAKEN_KEY
from tools.redis_server import EmbeddedRedis


def _cancel(r: redis.Redis[bytes], rid: str) -> int:
    keys = mark_keys(rid)
    return int(r.eval(MARK_SCRIPT, len(keys), *keys, *mark_args(rid, 600)))  # type: ignore[no-untyped-call]


def test_the_mark_says_for_good_or_held_and_a_cancel_for_good_stays_one(redis_server: EmbeddedRedis) -> None:
    r = redis_server.client()
    listener = r.pubsub()
    listener.subscribe(CANCEL_CHANNEL)
    assert (listener.get_message(timeout=10) or {}).get("type") == "subscribe"

    assert _cancel(r, "queued-1") == 0  # no worker took it: for good
    assert r.get(CANCEL_KEY.format(id="queued-1")) == FOR_GOOD.encode()
    assert 0 < r.ttl(CANCEL_KEY.format(id="queued-1")) <= 600

    r.set(TAKEN_KEY.format(id="held-1"), "1", ex=600)  # a worker took it without a mark
    assert _cancel(r, "held-1") == 1
    assert r.get(CANCEL_KEY.format(id="held-1")) == HELD.encode()

    r.set(RESULT_KEY.format(id="running-1"), json.dumps({"status": "STARTED"}))  # a worker runs it, note or not
    assert _cancel(r, "running-1") == 1
    assert r.get(CANCEL_KEY.format(id="running-1")) == HELD.encode()

    r.set(TAKEN_KEY.format(id="queued-1"), "1", ex=600)  # taken after its cancel for good (a BRPOP take notes it)
    assert _cancel(r, "queued-1") == 0  # cancelled again: still for good, never back to "held"
    assert r.get(CANCEL_KEY.format(id="queued-1")) == FOR_GOOD.encode()

    heard = [listener.get_message(timeout=10) for _ in range(4)]  # each cancel announced
    assert [m["data"] for m in heard if m] == [b"queued-1", b"held-1", b"running-1", b"queued-1"]
    listener.close()


def test_readers_take_only_a_cancel_for_good_for_cancelled() -> None:
    assert [cancelled_for_good(v) for v in (None, b"1", "1", b"held", "held")] == [False, True, True, False, False]
