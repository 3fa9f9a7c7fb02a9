"""``fleet dead-letter requeue`` puts back one copy per request ID (real redis-server, real workers, CLI in process).

A request ID can be dead-lettered twice (two copies of its message). Before, requeueing both entries (one
after the other, in one call, or by two operators at once) pushed both copies and a worker ran the request
twice, one outcome kept. Now the entry requeued first goes back, the others of its task ID are marked
``superseded_by`` it, and the ID's claim refuses any other requeue until the copy has an outcome; once it
has one, the stored result never changes (a requeue has nothing to requeue). A copy dead-lettered again
after its requeue (an outcome its dead-lettering stored) can go back again.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.cli import main as fleet_main
from producer.deadletter import DeadLetterStore
from protocol.deadletter import read_entry
from protocol.errors import InvalidRequest, RequestNotFound
from protocol.keys import DEAD_LETTER_KEY, RESULT_KEY
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tests.integration.test_dead_letter_ledger import _race, _two_copies_dead_lettered, _write
from tests.queue_items import envelope, good_body, raw
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis

QUEUE = "fleet.demo-lm"
REQUEST = {"model": "demo-lm", "input_ids": [5, 6, 7], "output": {"top_k": 2}}


def _cli(capsys: pytest.CaptureFixture[str], config: Path, *argv: str) -> tuple[int, Any]:
    """``fleet dead-letter ...`` in this process: its exit code and the JSON it printed (or None)."""
    code = fleet_main(["dead-letter", argv[0], "--config", str(config), *argv[1:]])
    lines = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines else None


def _queued_ids(r: redis.Redis[bytes]) -> list[str]:
    return [json.loads(item)["headers"]["id"] for item in r.lrange(QUEUE, 0, -1)]


def _received(log: Path | None, task_id: str) -> int:
    """Times the worker took ``task_id`` to run, from its log."""
    text = log.read_text() if log is not None and log.exists() else ""
    return len(re.findall(rf"Task fleet\.infer\[{re.escape(task_id)}\] received", text))


def test_two_dead_letters_of_one_request_requeued_run_it_once_and_its_success_stays(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """Old code: both requeues answered ``requeued: true`` and the worker ran ``dup-1`` twice."""
    cfg, worker, client, r = _two_copies_dead_lettered(fleet, "dup-1")
    poll_until(lambda: r.hlen("unacked") == 0, 30, "both copies acked")
    worker.stop(timeout_s=15)  # what a requeue pushes stays on the queue, to be counted

    code, listed = _cli(capsys, cfg, "list")
    newest, oldest = [e["id"] for e in listed["entries"]]
    code, first = _cli(capsys, cfg, "requeue", oldest)
    assert code == 0 and first["requeued"] is True, first
    code_second, second = _cli(capsys, cfg, "requeue", newest)
    code_forced, forced = _cli(capsys, cfg, "requeue", "dup-1", "--force")  # by task ID, forced: still one copy
    queued = _queued_ids(r)

    runner = fleet.worker(cfg)
    result = client.result("dup-1", wait=True, timeout_s=60)
    assert isinstance(result, InferenceResult) and result.top_k is not None
    poll_until(lambda: r.llen(QUEUE) == 0 and r.hlen("unacked") == 0, 30, "the requeued copies acked")
    assert _received(runner.log_path, "dup-1") == 1, (queued, second, forced)

    assert queued == ["dup-1"] and first["superseded"] == 1, first
    assert code_second == 2 and second["type"] == "InvalidRequest", second
    assert second["field"] == "id" and second["limit"] == "requeued"
    assert second["message"].startswith(f"request dup-1 was requeued already (entry {oldest}, at "), second
    assert code_forced == 2 and forced["limit"] == "requeued", forced
    code, listed = _cli(capsys, cfg, "list")
    assert [(e["id"], e["superseded_by"]) for e in listed["entries"]] == [(newest, oldest)]
    stored = r.get(RESULT_KEY.format(id="dup-1"))

    # with SUCCESS stored, the superseded entry and a copy dead-lettered later have nothing to requeue: the
    # result never changes (this part was right before too)
    runner.stop(timeout_s=15)
    _write(fleet.redis_url, "dup-1")
    for ident in (newest, "dup-1"):
        code, refused = _cli(capsys, cfg, "requeue", ident)
        assert code == 2 and refused["limit"] == "SUCCESS", refused
        assert refused["message"].startswith("nothing to requeue: its request dup-1 already has an outcome stored")
    assert r.llen(QUEUE) == 0 and r.get(RESULT_KEY.format(id="dup-1")) == stored


def test_requeue_of_both_ids_in_one_call_queues_one_copy(
    redis_server: EmbeddedRedis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Old code: ``requeue A B`` was a usage error (one ID only), and A then B queued both copies."""
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(f"redis_url: {redis_server.url}\n")
    r = redis.Redis.from_url(redis_server.url)
    _write(redis_server.url, "both-1")
    _write(redis_server.url, "both-1")
    _write(redis_server.url, "other-1")
    ids = [read_entry(item).id for item in r.lrange(DEAD_LETTER_KEY, 0, -1)]  # other-1, both-1 (new), both-1 (old)
    code, doc = _cli(capsys, cfg, "requeue", ids[1], ids[2], ids[0])
    assert code == 2 and doc["requeued"] == 2 and doc["refused"] == 1 and doc["superseded"] == 1, doc
    assert [(e["id"], e["requeued"]) for e in doc["entries"]] == [(ids[1], True), (ids[2], False), (ids[0], True)]
    assert doc["entries"][1]["limit"] == "requeued"
    assert sorted(_queued_ids(r)) == ["both-1", "other-1"]


def test_operators_racing_on_two_entries_of_one_request_queue_it_once(redis_server: EmbeddedRedis) -> None:
    """Two operators requeue the two entries of one request ID at the same moment. Old code: both queued it."""
    r = redis.Redis.from_url(redis_server.url)
    task_ids = [f"pair-{i}" for i in range(20)]
    for task_id in task_ids:
        _write(redis_server.url, task_id)
        _write(redis_server.url, task_id)
    stores = [DeadLetterStore(redis.Redis.from_url(redis_server.url)) for _ in range(2)]
    entries: dict[str | None, list[str]] = defaultdict(list)
    for _, e in stores[0].entries():
        entries[e.task_id].append(e.id)
    for task_id in task_ids:
        a, b = entries[task_id]
        outcomes = _race(lambda a=a: stores[0].requeue(a), lambda b=b: stores[1].requeue(b))  # type: ignore[misc]
        won = [o for o in outcomes if isinstance(o, tuple)]  # a Requeued
        lost = [o for o in outcomes if not isinstance(o, tuple)]
        assert len(won) == 1 and len(lost) == 1, outcomes
        assert isinstance(lost[0], RequestNotFound | InvalidRequest), lost
    queued = _queued_ids(r)
    assert sorted(queued) == sorted(task_ids), queued


def test_a_copy_dead_lettered_after_the_requeue_is_refused_while_the_first_is_out(redis_server: EmbeddedRedis) -> None:
    """The entry did not exist when the first requeue marked the others: the ID's claim refuses it. Old code:
    queued a second copy."""
    r = redis.Redis.from_url(redis_server.url)
    store = DeadLetterStore(redis.Redis.from_url(redis_server.url))
    _write(redis_server.url, "late-1")
    first = store.requeue("late-1")[0]  # the entry that went back
    assert _queued_ids(r) == ["late-1"]
    _write(redis_server.url, "late-1")
    with pytest.raises(InvalidRequest) as refused:
        store.requeue("late-1", force=True)
    assert refused.value.field == "id" and refused.value.limit == "requeued"
    assert f"(entry {first.id}, at " in refused.value.message
    assert _queued_ids(r) == ["late-1"] and r.llen(DEAD_LETTER_KEY) == 1


def test_a_requeued_copy_dead_lettered_again_can_go_back_again(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """The claim holds only while the copy has no outcome: one dead-lettered again (its FAILURE is the guard's) goes
    back on the next requeue (as before)."""
    cfg = fleet.config()
    fleet.worker(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    r.lpush(QUEUE, raw(envelope(QUEUE, good_body(REQUEST), task="fleet.not-yet", task_id="again-1")))
    poll_until(lambda: r.llen(DEAD_LETTER_KEY) == 1, 30, "dead-lettered as unknown_task")
    poll_until(lambda: r.get(RESULT_KEY.format(id="again-1")), 30, "its FAILURE stored")
    first = read_entry(r.lindex(DEAD_LETTER_KEY, 0) or b"").id
    code, doc = _cli(capsys, cfg, "requeue", "again-1")
    assert code == 0 and doc["id"] == first and doc["failures_cleared"] == 1, doc
    poll_until(lambda: (r.llen(DEAD_LETTER_KEY) == 1 and read_entry(r.lindex(DEAD_LETTER_KEY, 0) or b"").id != first
                        and r.get(RESULT_KEY.format(id="again-1"))), 30, "dead-lettered again")  # fmt: skip
    code, doc = _cli(capsys, cfg, "requeue", "again-1")
    assert code == 0 and doc["requeued"] is True and doc["id"] != first, doc


def test_list_pages_through_next_cursor_while_entries_arrive(
    redis_server: EmbeddedRedis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``list --limit N`` then ``--after <next_cursor>`` reaches every entry once, new ones arriving in between.
    Old code: no ``next_cursor`` and no ``--after`` (a usage error)."""
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(f"redis_url: {redis_server.url}\n")
    for i in range(5):
        _write(redis_server.url, f"page-{i}")
    seen: list[str] = []
    code, page = _cli(capsys, cfg, "list", "--limit", "2")
    while True:
        assert code == 0, page
        seen += [e["task_id"] for e in page["entries"]]
        if page["next_cursor"] is None:
            break
        _write(redis_server.url, f"new-{len(seen)}")  # lands in front of the first page
        code, page = _cli(capsys, cfg, "list", "--limit", "2", "--after", page["next_cursor"])
    assert seen == [f"page-{i}" for i in reversed(range(5))] and page["count"] == 7
    code, refused = _cli(capsys, cfg, "list", "--after", "gone-entry")
    assert code == 2 and refused["field"] == "after" and refused["type"] == "InvalidRequest", refused
