"""``fleet dead-letter list|show|requeue|purge`` against entries a real worker wrote."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

import protocol.deadletter
from producer.cli import main as fleet_main
from protocol.deadletter import Reason, encode_entry, make_entry
from protocol.keys import DEAD_LETTER_KEY, DELIVERIES_KEY
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tests.queue_items import EMBED, envelope, good_body, raw

QUEUE = "fleet.demo-lm"
REQUEST = {"model": "demo-lm", "input_ids": [5, 6, 7], "output": {"top_k": 2}}


def fleet_json(capsys: pytest.CaptureFixture[str], config: Path, *argv: str) -> tuple[int, Any]:
    """Run ``fleet dead-letter ...`` in this process; returns its exit code and the JSON it printed."""
    code = fleet_main(["dead-letter", argv[0], "--config", str(config), *argv[1:]])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1]) if out else None


def _wait_for_entries(r: redis.Redis[bytes], n: int) -> None:
    deadline = time.monotonic() + 30
    while r.llen(DEAD_LETTER_KEY) < n:
        assert time.monotonic() < deadline, f"{r.llen(DEAD_LETTER_KEY)} dead letters, expected {n}"
        time.sleep(0.05)


def test_list_show_requeue_purge(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)

    # a good message that (as far as the counter knows) already killed 3 workers, one for a task no
    # worker here runs, and one whose body is not [args, kwargs, embed]
    gave_up = envelope(QUEUE, good_body(REQUEST), task_id="gave-up-1")
    gave_up["headers"]["redelivered"] = True
    gave_up["properties"]["delivery_info"]["redelivered"] = True
    r.set(DELIVERIES_KEY.format(id="gave-up-1"), 3)
    r.lpush(QUEUE, raw(gave_up))
    r.lpush(QUEUE, raw(envelope(QUEUE, good_body(REQUEST), task="fleet.not-here", task_id="unknown-1")))
    r.lpush(QUEUE, raw(envelope(QUEUE, b'{"model": "demo-lm"}', task_id="bad-body-1")))
    _wait_for_entries(r, 3)

    code, doc = fleet_json(capsys, cfg, "list")
    assert code == 0 and doc["count"] == 3
    assert [(e["task_id"], e["reason"], e["queue"]) for e in doc["entries"]] == [
        ("bad-body-1", "bad_body", QUEUE), ("unknown-1", "unknown_task", QUEUE), ("gave-up-1", "max_deliveries", QUEUE),
    ]
    assert all(e["id"] and e["dead_lettered_at"] and e["detail"] for e in doc["entries"])
    code, doc = fleet_json(capsys, cfg, "list", "--limit", "1")
    assert code == 0 and doc["count"] == 3 and len(doc["entries"]) == 1

    code, shown = fleet_json(capsys, cfg, "show", "bad-body-1")  # by task ID
    assert code == 0 and shown["reason"] == "bad_body" and shown["field"] == "body"
    assert shown["requeue_allowed"] is False and json.loads(shown["raw"])["headers"]["id"] == "bad-body-1"
    code, by_id = fleet_json(capsys, cfg, "show", shown["id"])  # by entry ID
    assert code == 0 and by_id == shown
    code, missing = fleet_json(capsys, cfg, "show", "no-such-entry")
    assert code == 1 and missing["type"] == "RequestNotFound"

    # a malformed body is not requeued unless forced
    code, refused = fleet_json(capsys, cfg, "requeue", "bad-body-1")
    assert code == 2 and refused["type"] == "InvalidRequest" and refused["field"] == "force"
    assert r.llen(DEAD_LETTER_KEY) == 3

    # the message the counter gave up on goes back, its count and its FAILURE cleared, and now runs
    assert client.status("gave-up-1").value == "failed"
    code, requeued = fleet_json(capsys, cfg, "requeue", "gave-up-1")
    assert code == 0 and requeued["requeued"] is True and requeued["failure_cleared"] is True
    assert requeued["reason"] == "max_deliveries" and requeued["queue"] == QUEUE
    result = client.result("gave-up-1", wait=True, timeout_s=30)
    assert isinstance(result, InferenceResult) and result.top_k is not None and len(result.top_k) == 2
    assert r.llen(DEAD_LETTER_KEY) == 2

    # forced: the malformed message goes back and is dead-lettered again, as a new entry
    code, forced = fleet_json(capsys, cfg, "requeue", shown["id"], "--force")
    assert code == 0 and forced["forced"] is True
    deadline = time.monotonic() + 30
    while True:
        code, doc = fleet_json(capsys, cfg, "list")
        if [e["task_id"] for e in doc["entries"]] == ["bad-body-1", "unknown-1"]:
            break
        assert time.monotonic() < deadline, doc
        time.sleep(0.05)
    assert doc["entries"][0]["id"] != shown["id"]

    code, purged = fleet_json(capsys, cfg, "purge", "--older-than", "3600")
    assert code == 0 and purged == {"purged": 0, "remaining": doc["count"]}
    code, purged = fleet_json(capsys, cfg, "purge", "--older-than", "0")
    assert code == 0 and purged["purged"] == doc["count"] and purged["remaining"] == 0
    r.lpush(QUEUE, raw(envelope(QUEUE, b"[1, 2]", task_id="bad-body-2")))
    _wait_for_entries(r, 1)
    code, purged = fleet_json(capsys, cfg, "purge", "--all")
    assert code == 0 and purged == {"purged": 1, "remaining": 0}


def test_requeue_clears_the_guard_failure_before_the_message_is_back_on_its_queue(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker may take the requeued message at once and store its result, which is written once: the
    dead-letter FAILURE goes in the script that puts the message back, before it (the order of the commands
    Redis ran)."""
    import threading

    cfg = fleet.config()
    fleet.worker(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    gave_up = envelope(QUEUE, good_body(REQUEST), task_id="order-1")
    gave_up["headers"]["redelivered"] = True
    gave_up["properties"]["delivery_info"]["redelivered"] = True
    r.set(DELIVERIES_KEY.format(id="order-1"), 3)
    r.lpush(QUEUE, raw(gave_up))
    _wait_for_entries(r, 1)

    seen: list[str] = []
    listening = threading.Event()

    def monitor() -> None:
        with r.monitor() as m:
            listening.set()
            for item in m.listen():
                seen.append(str(item["command"]))
                if "monitor-end" in item["command"]:
                    return

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    assert listening.wait(10)
    r.echo("monitor-start")
    deadline = time.monotonic() + 10
    while not any("monitor-start" in c for c in seen):
        assert time.monotonic() < deadline, f"MONITOR showed no monitor-start in 10 s: {seen[-5:]}"
        time.sleep(0.01)
    code, requeued = fleet_json(capsys, cfg, "requeue", "order-1")
    r.echo("monitor-end")
    thread.join(10)
    assert not thread.is_alive(), f"MONITOR showed no monitor-end in 10 s: {seen[-5:]}"  # seen is complete
    assert code == 0 and requeued["failure_cleared"] is True
    script = next(i for i, c in enumerate(seen) if c.split()[0].upper() in ("EVAL", "EVALSHA") and DEAD_LETTER_KEY in c
                  and QUEUE in c)  # fmt: skip
    forget = next(i for i, c in enumerate(seen) if "celery-task-meta-order-1" in c and c.split()[0].upper()
                  in ("DEL", "UNLINK"))  # fmt: skip
    back = next(i for i, c in enumerate(seen) if c.split()[0].upper() == "LPUSH" and QUEUE in c and i > script)
    assert script < forget < back, seen[script : back + 1]  # one script: no worker takes it in between
    result = fleet.client(cfg).result("order-1", wait=True, timeout_s=30)
    assert isinstance(result, InferenceResult)


def test_a_dead_lettered_bulk_message_fails_each_of_its_requests_and_a_requeue_runs_them(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """The requests of a bulk message wait on their own IDs: dead-lettered, the message stored a FAILURE under
    its task ID only, and its requests read as queued for ever. Each now fails with it (a request that already
    has an outcome keeps it), and a requeue clears those FAILUREs in the step that puts the message back."""
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    done = client.submit("demo-lm", [5, 6], request_id="bulk-dl-done")
    assert client.result(done, wait=True, timeout_s=60) is not None
    before = r.get(f"celery-task-meta-{done}")
    items = [{"request_id": rid, "model": "demo-lm", "input_ids": [5, 6, 7]}
             for rid in ("bulk-dl-1", "bulk-dl-2", done)]  # fmt: skip
    body = json.dumps([[{"requests": items}], {}, EMBED]).encode()
    gave_up = envelope(QUEUE, body, task="fleet.infer_bulk", task_id="bulk-dl")
    gave_up["headers"]["redelivered"] = True
    r.set(DELIVERIES_KEY.format(id="bulk-dl"), 3)
    r.lpush(QUEUE, raw(gave_up))
    _wait_for_entries(r, 1)
    for rid in ("bulk-dl-1", "bulk-dl-2"):
        [failed] = client.wait([rid], 30)
        assert isinstance(failed, Exception) and "dead-lettered (max_deliveries)" in str(failed), failed
    assert r.get(f"celery-task-meta-{done}") == before  # its own outcome, kept
    code, requeued = fleet_json(capsys, cfg, "requeue", "bulk-dl")
    assert code == 0 and requeued["failures_cleared"] == 3  # the task's and its two requests'
    for rid in ("bulk-dl-1", "bulk-dl-2"):
        assert isinstance(client.wait([rid], 30)[0], InferenceResult)
    assert r.get(f"celery-task-meta-{done}") == before


def test_an_item_of_control_bytes_is_kept_whole_and_one_past_the_cap_is_kept_in_part_and_never_requeued(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue item of control bytes was kept as JSON text, six bytes per byte (``\\u0001``): 90 MB of them came
    to 540 MB, over Redis's 512 MB for one value; the entry's write failed after the item had left its queue,
    and it was gone without a trace. Now it is kept as base64 (4/3), and an item past ``MAX_RAW_BYTES`` keeps
    its first bytes, its size and its SHA-256, and is never requeued (``--force`` or not): it is not whole."""
    cfg = fleet.config()
    fleet.worker(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    item = b"\x01" * 2_000_000
    r.lpush(QUEUE, item)
    _wait_for_entries(r, 1)
    stored = r.lindex(DEAD_LETTER_KEY, 0) or b""
    assert len(stored) < 1.4 * len(item), len(stored)  # was 6x: 12 MB
    code, shown = fleet_json(capsys, cfg, "show", json.loads(stored)["id"])
    assert code == 0 and shown["reason"] == "not_json" and shown["raw_encoding"] == "base64", shown
    assert base64.b64decode(shown["raw"]) == item and shown["raw_truncated_from"] is None

    monkeypatch.setattr(protocol.deadletter, "MAX_RAW_BYTES", 500)
    whole = raw(envelope(QUEUE, good_body(REQUEST), task="fleet.not-here", task_id="too-big-1"))
    cut = make_entry(whole, reason=Reason.UNKNOWN_TASK, detail="no such task", field="headers.task", queue=QUEUE,
                     list_key=QUEUE, now_unix_s=time.time(), task_id="too-big-1", task="fleet.not-here")  # fmt: skip
    assert cut.raw_bytes() == whole[:500] and cut.raw_truncated_from == len(whole)
    assert cut.raw_sha256 == hashlib.sha256(whole).hexdigest()
    r.lpush(DEAD_LETTER_KEY, encode_entry(cut))
    for force in ((), ("--force",)):
        code, refused = fleet_json(capsys, cfg, "requeue", cut.id, *force)
        assert code == 2 and refused["field"] == "raw" and "cannot be requeued" in refused["message"], refused
    assert r.llen(QUEUE) == 0 and r.llen(DEAD_LETTER_KEY) == 2
