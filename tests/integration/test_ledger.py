"""tools.ledger against a real fleet: a clean run passes, and each footprint a silent failure leaves is caught.

The footprints are the Redis states the failures reported against the fleet left behind, written here on
top of a real run (real redis-server, real worker, real ONNX model), since the failures themselves no
longer happen:

* a wedged worker: the request's message sits in kombu's unacked hash, no result ever comes;
* a bulk submit that overwrote a finished result: the stored SUCCESS changes after it was seen;
* a batch route that said "nothing was queued" and queued anyway: a refused ID has a result;
* a Redis restart that cut a token stream: the stream stops before its final event;
* a take killed between pop and record: the message is in no queue and not unacked, no result.
"""

from __future__ import annotations

import json

import pytest
import redis

from protocol.keys import STREAM_KEY
from tests.integration.fleet_fixtures import Fleet
from tools.ledger import Ledger, LedgerViolationError

MODEL = "demo-lm"


def _queue_message(r: redis.Redis[bytes], queue: str, request_id: str) -> bytes:
    """The raw message of ``request_id`` in ``queue`` (the list item a worker would pop)."""
    for raw in r.lrange(queue, 0, -1):
        if json.loads(raw)["headers"]["id"] == request_id:
            return raw
    raise AssertionError(f"{request_id} is not in {queue}")


@pytest.mark.slow
def test_a_clean_run_passes_and_each_silent_failure_is_caught(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg, MODEL)
    client = fleet.client(cfg)
    queue = client.settings.queue_for(MODEL)
    r = redis.Redis.from_url(fleet.redis_url)
    ledger = Ledger(r, queues=[queue])

    plain = [client.submit(MODEL, [5, 6, i]) for i in range(8)]
    streamed = [client.submit(MODEL, [7, i], generation={"max_new_tokens": 6}) for i in range(2)]
    for rid in plain:
        ledger.accepted(rid)
    for rid in streamed:
        ledger.accepted(rid, streamed=True)
    for rid in plain + streamed:
        client.result(rid, wait=True, timeout_s=120)
    assert ledger.wait_terminal(60)
    fleet.workers[0].stop(timeout_s=15)  # gone: its heartbeat no longer counts what it holds
    clean = ledger.check()
    assert clean.ok, clean.as_dict()
    assert clean.terminal == {"SUCCESS": 10} and clean.streamed == 2

    # a bulk submit that overwrote a finished result
    done = plain[0]
    meta_key = f"celery-task-meta-{done}"
    doc = json.loads(r.get(meta_key) or b"{}")
    doc["result"] = {"overwritten": True}
    r.set(meta_key, json.dumps(doc))
    # a batch route that refused and queued anyway: the refused ID ran
    ledger.refused(plain[1] + "-refused")
    r.set(f"celery-task-meta-{plain[1]}-refused", json.dumps({"status": "SUCCESS", "result": {}}))
    # a cancel for good (read as cancelled) whose request then ran: a worker that missed the mark
    r.set(f"fleet:cancel:{plain[2]}", "1")
    # one asked of the worker that held it, whose result won: kept
    r.set(f"fleet:cancel:{plain[3]}", "held")
    # a cut stream: the final event never written
    last_id = r.xrevrange(STREAM_KEY.format(id=streamed[0]), count=1)[0][0]
    r.xdel(STREAM_KEY.format(id=streamed[0]), last_id)
    # a wedge: a request taken into kombu's unacked hash that never gets a result
    wedged = client.submit(MODEL, [9, 9], request_id="wedged-1")
    raw = _queue_message(r, queue, wedged)
    r.lrem(queue, 1, raw)
    r.hset("unacked", "tag-wedged", json.dumps([json.loads(raw), "", queue]))
    r.zadd("unacked_index", {"tag-wedged": 1.0})
    ledger.accepted(wedged)
    # a take killed between pop and record: the message is simply gone
    lost = client.submit(MODEL, [8, 8], request_id="lost-1")
    r.lrem(queue, 1, _queue_message(r, queue, lost))
    ledger.accepted(lost)
    # and one still waiting in the queue
    waiting = client.submit(MODEL, [4, 4], request_id="waiting-1")
    ledger.accepted(waiting)

    report = ledger.check()
    by_id = {(v.kind, v.request_id) for v in report.violations}
    assert ("terminal_changed", done) in by_id
    assert ("refused_ran", plain[1] + "-refused") in by_id
    assert ("stream_open", streamed[0]) in by_id
    assert ("cancel_overridden", plain[2]) in by_id and ("cancel_overridden", plain[3]) not in by_id
    assert ("not_terminal", wedged) in by_id and ("unacked_left", wedged) in by_id
    assert ("lost", lost) in by_id
    assert ("not_terminal", waiting) in by_id and ("queued_left", waiting) in by_id
    assert ("stream_open", streamed[1]) not in by_id
    assert report.kinds() == {
        "terminal_changed": 1, "refused_ran": 1, "cancel_overridden": 1, "stream_open": 1, "not_terminal": 2,
        "unacked_left": 1, "lost": 1, "queued_left": 1,
    }
    with pytest.raises(LedgerViolationError, match="lost lost-1"):
        report.raise_if_broken()


def test_a_worker_holding_requests_is_reported(fleet: Fleet) -> None:
    """A live worker whose heartbeat reports requests in flight at the end of a run is ``held``."""
    r = redis.Redis.from_url(fleet.redis_url)
    r.set("fleet:worker:w-held@test", json.dumps({"hostname": "w-held@test", "in_flight": 3}), ex=30)
    report = Ledger(r).check()
    assert [(v.kind, v.detail) for v in report.violations] == [("held", "worker w-held@test reports 3 in flight")]
