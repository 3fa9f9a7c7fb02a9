"""Request IDs reaching a worker from a plain Celery client are held to the rule every other face enforces
(:data:`protocol.keys.REQUEST_ID_PATTERN`): an item of a bulk message, or a ``fleet.infer`` task ID, that breaks
it is refused and nothing is stored under it (a key no client can poll: ``GET /v1/requests/{id}`` and the
Python client refuse such an ID); the worker serves on.

Real redis-server, one real ``celery worker`` of the demo LM, a plain ``celery.Celery`` app as the producer.
"""

from __future__ import annotations

import json

import redis
from celery import Celery

from protocol.deadletter import Reason, read_entry
from protocol.keys import DEAD_LETTER_KEY, REQUEST_ID_PATTERN
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tools.ledger import Ledger
from tools.processes import poll_until

MODEL = "demo-lm"
QUEUE = "fleet.demo-lm"
REQUEST = {"model": MODEL, "input_ids": [5, 6, 7]}
BAD_IDS = {
    "300 characters": "x" * 300,
    "129 characters": "y" * 129,  # within InferenceRequest's 200, past the rule's 128
    "CR/LF": "a\r\nb",
    "newline at the end": "tail\n",
    "non-ASCII": "caf\u00e9",
    "a space": "a b",
}


def _result_keys(r: redis.Redis[bytes]) -> set[bytes]:
    return set(r.scan_iter(match="celery-task-meta-*", count=1000))


def test_bulk_items_whose_request_id_breaks_the_rule_are_refused_by_position(fleet: Fleet) -> None:
    """Before, the 300-character item's DecodeError was stored under its 300-character ID and every other one ran
    and stored its SUCCESS under a key holding a CR/LF, an ``é``, a space: results no client could poll."""
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    items = [{"request_id": "good-1", **REQUEST}]
    items += [{"request_id": rid, **REQUEST} for rid in BAD_IDS.values()]
    items.append({"request_id": "good-2", **REQUEST})
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    try:
        sent = plain.send_task("fleet.infer_bulk", args=[{"requests": items}], queue=QUEUE)
        summary = sent.get(timeout=60)
    finally:
        plain.close()
    assert summary["count"] == len(items) and summary["succeeded"] == 2, summary
    refused = {entry["index"]: entry for entry in summary.get("refused", [])}
    assert sorted(refused) == list(range(1, len(BAD_IDS) + 1)), summary
    for pos, entry in refused.items():
        assert entry["type"] == "DecodeError" and entry["field"] == f"requests[{pos}].request_id", entry
        assert entry["limit"] == REQUEST_ID_PATTERN and "128" in entry["message"], entry
        assert entry["request_id"] is None, entry  # no usable ID: named by its position
    good = client.wait(["good-1", "good-2"], 10)
    assert all(isinstance(g, InferenceResult) for g in good), good
    stored = _result_keys(r)
    assert stored == {b"celery-task-meta-good-1", b"celery-task-meta-good-2", f"celery-task-meta-{sent.id}".encode()}


def test_a_plain_task_whose_id_breaks_the_rule_is_dead_lettered_and_nothing_is_stored(fleet: Fleet) -> None:
    """Before, ``send_task('fleet.infer', task_id='a\\nb')`` ran and stored its SUCCESS under
    ``celery-task-meta-a\\nb`` (a 300-character one was dead-lettered, and its FAILURE stored under it when 256 or
    fewer): a result under a key no client can poll, outside the ledger. Now each is dead-lettered (acked,
    kept whole in the dead-letter list, its reason naming ``headers.id`` and the rule), nothing is stored
    under it, and the worker serves on."""
    cfg = fleet.config()
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    try:
        for rid in BAD_IDS.values():
            plain.send_task("fleet.infer", args=[REQUEST], task_id=rid, queue=QUEUE)
        plain.send_task("fleet.infer", args=[REQUEST], task_id="plain-good", queue=QUEUE)
    finally:
        plain.close()
    entries = poll_until(lambda: [read_entry(e) for e in r.lrange(DEAD_LETTER_KEY, 0, -1)] if r.llen(
        DEAD_LETTER_KEY) >= len(BAD_IDS) else None, 60, "a dead letter for each bad task ID")  # fmt: skip
    assert len(entries) == len(BAD_IDS)
    for entry in entries:
        assert entry.reason is Reason.BAD_HEADERS and entry.field == "headers.id", entry
        assert entry.task_id is None and "128" in entry.detail, entry  # the rule, in words
        assert json.loads(entry.raw_bytes())["headers"]["id"] in BAD_IDS.values()  # the whole message kept
    good = client.result("plain-good", wait=True, timeout_s=30)
    assert isinstance(good, InferenceResult)
    ledger = Ledger(r, queues=[QUEUE])
    ledger.accepted("plain-good")
    report = ledger.check_settled(30)  # nothing left queued or unacked: the refused ones were acked
    assert report.ok, report.as_dict()
    assert _result_keys(r) == {b"celery-task-meta-plain-good"}
    assert worker.proc is not None and worker.proc.poll() is None, worker.log_tail()
