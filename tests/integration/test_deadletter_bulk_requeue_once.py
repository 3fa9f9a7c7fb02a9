"""``fleet dead-letter requeue`` runs each request ID once across bulk messages (real redis-server, real workers).

A ``fleet.infer_bulk`` message carries many request IDs under a task ID of its own, so two dead-lettered
messages (two bulks, or a bulk and a single ``fleet.infer``) can carry one request ID under different task IDs.
Before, the one-copy-per-ID rule keyed on the task ID only: requeueing all three entries put the shared request
back three times and a worker ran it three times (one outcome kept). Now each request ID put back is claimed: a
later bulk requeue drops the claimed requests from the message it puts back (``dropped``), a single whose ID is
out is refused, and an entry whose every request went back is marked ``superseded_by`` the requeue.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

import producer.deadletter
from broker.dead_letter_writer import write_dead_letter
from broker.message_check import Refused, bulk_request_ids
from producer.cli import main as fleet_main
from producer.deadletter import DeadLetterStore
from producer.deadletter_requeue import BulkPlan, plan_bulk
from protocol.deadletter import REQUEUED_KEY, Reason
from protocol.errors import InvalidRequest
from protocol.keys import DEAD_LETTER_KEY, DELIVERIES_KEY, RESULT_KEY
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tests.integration.test_dead_letter_ledger import _connection, _race
from tests.integration.test_deadletter_requeue_once import _received
from tests.queue_items import EMBED, envelope, good_body, raw
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis

QUEUE = "fleet.demo-lm"


def _bulk(task_id: str, request_ids: list[str]) -> bytes:
    """A ``fleet.infer_bulk`` message that (as far as the counter knows) already killed 3 workers."""
    items = [{"request_id": rid, "model": "demo-lm", "input_ids": [5, 6, 7]} for rid in request_ids]
    item = envelope(QUEUE, json.dumps([[{"requests": items}], {}, EMBED]).encode(), task="fleet.infer_bulk",
                    task_id=task_id)  # fmt: skip
    item["headers"]["redelivered"] = True
    item["headers"]["argsrepr"] = json.dumps([{"bulk_requests": len(items), "request_ids": request_ids}])
    return raw(item)


def _single(task_id: str) -> bytes:
    item = envelope(QUEUE, good_body({"model": "demo-lm", "input_ids": [5, 6, 7]}), task_id=task_id)
    item["headers"]["redelivered"] = True
    return raw(item)


def _queued_requests(r: redis.Redis[bytes]) -> Counter[str]:
    """How many queued messages would run each request ID (a bulk message's requests', a single's task ID)."""
    runs: Counter[str] = Counter()
    for item in r.lrange(QUEUE, 0, -1):
        runs.update(bulk_request_ids(item) or [json.loads(item)["headers"]["id"]])
    return runs


def _cli(capsys: pytest.CaptureFixture[str], config: Path, *argv: str) -> tuple[int, Any]:
    code = fleet_main(["dead-letter", argv[0], "--config", str(config), *argv[1:]])
    lines = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines else None


def test_a_request_shared_by_two_bulks_and_a_single_runs_once(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    """Old code: all three requeues answered ``requeued: true`` and the worker ran ``s-2`` three times."""
    cfg = fleet.config()
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    for task_id in ("bulk-a", "bulk-b", "s-2"):
        r.set(DELIVERIES_KEY.format(id=task_id), 3)
    r.lpush(QUEUE, _bulk("bulk-a", ["s-1", "s-2"]), _bulk("bulk-b", ["s-2", "s-3"]), _single("s-2"))
    poll_until(lambda: r.llen(DEAD_LETTER_KEY) == 3, 30, "the three messages dead-lettered")
    poll_until(lambda: r.hlen("unacked") == 0, 30, "the three acked")
    worker.stop(timeout_s=15)  # what the requeues push stays on the queue, to be counted

    code_a, first = _cli(capsys, cfg, "requeue", "bulk-a")
    code_b, second = _cli(capsys, cfg, "requeue", "bulk-b")
    code_s, single = _cli(capsys, cfg, "requeue", "s-2", "--force")
    queued = _queued_requests(r)
    argsreprs = sorted(json.loads(item)["headers"]["argsrepr"] for item in r.lrange(QUEUE, 0, -1))

    runner = fleet.worker(cfg)
    for rid in ("s-1", "s-2", "s-3"):
        assert isinstance(client.result(rid, wait=True, timeout_s=60), InferenceResult), rid
    poll_until(lambda: r.llen(QUEUE) == 0 and r.hlen("unacked") == 0, 30, "the requeued copies acked")
    received = {t: _received(runner.log_path, t) for t in ("s-2",)}
    log = runner.log_path.read_text() if runner.log_path is not None else ""
    bulk_runs = {t: log.count(f"Task fleet.infer_bulk[{t}] received") for t in ("bulk-a", "bulk-b")}

    assert queued == {"s-1": 1, "s-2": 1, "s-3": 1}, (queued, second, single)
    assert bulk_runs == {"bulk-a": 1, "bulk-b": 1} and received == {"s-2": 0}, (bulk_runs, received)
    for task_id, count in (("bulk-a", 2), ("bulk-b", 1)):  # each copy's summary: the requests it ran
        meta = json.loads(r.get(RESULT_KEY.format(id=task_id)) or b"{}")
        assert meta["status"] == "SUCCESS" and meta["result"]["count"] == count, meta
    assert code_a == 0 and first["superseded"] == 1, first  # the single s-2: its one request went back
    assert code_b == 0 and second["dropped"] == ["s-2"] and second["superseded"] == 0, second
    assert code_s == 2 and single["limit"] == "requeued" and single["field"] == "id", single
    assert argsreprs[0] == '[{"bulk_requests": 1, "request_ids": ["s-3"]}]', argsreprs  # bulk-b's weight: s-3 left
    _, listed = _cli(capsys, cfg, "list")
    assert [(e["task_id"], e["superseded_by"]) for e in listed["entries"]] == [("s-2", first["id"])], listed


def _write(url: str, item: bytes, task_id: str, task: str = "fleet.infer_bulk") -> None:
    refused = Refused(Reason.MAX_DELIVERIES, "deliveries", "delivered 3 times without an ack", "2", task_id, task, 4)
    write_dead_letter(lambda: _connection(url), None, QUEUE, QUEUE, item, refused)


def test_a_bulk_whose_every_request_is_out_is_refused_naming_them(redis_server: EmbeddedRedis) -> None:
    """Old code: the second bulk went back (its task ID differs) and ran both requests again."""
    r = redis.Redis.from_url(redis_server.url)
    _write(redis_server.url, _bulk("bulk-c", ["t-1", "t-2"]), "bulk-c")
    _write(redis_server.url, _bulk("bulk-d", ["t-2", "t-1"]), "bulk-d")
    store = DeadLetterStore(redis.Redis.from_url(redis_server.url))
    first = store.requeue("bulk-c")
    assert first.superseded == 1 and first.dropped == ()  # bulk-d carries nothing else
    with pytest.raises(InvalidRequest) as refused:
        store.requeue("bulk-d")
    assert refused.value.field == "id" and refused.value.limit == "requeued"
    assert "request t-2 was requeued already (entry " in refused.value.message
    assert "request t-1 was requeued already" in refused.value.message
    assert _queued_requests(r) == {"t-1": 1, "t-2": 1} and r.llen(DEAD_LETTER_KEY) == 1


def test_a_request_claimed_between_the_plan_and_the_requeue_is_dropped_on_the_next_plan(
    redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another requeue claims ``u-2`` after this one read the claims: the step refuses that plan, the next drops it."""
    r = redis.Redis.from_url(redis_server.url)
    _write(redis_server.url, _bulk("bulk-e", ["u-1", "u-2"]), "bulk-e")
    plans: list[BulkPlan] = []

    def plan_then_claimed(client: Any, request_ids: list[str]) -> BulkPlan:
        plans.append(plan_bulk(client, request_ids))
        r.set(REQUEUED_KEY.format(id="u-2"), json.dumps({"entry": "other", "at_unix_s": 0}), ex=60)
        return plans[-1]

    monkeypatch.setattr(producer.deadletter, "plan_bulk", plan_then_claimed)
    done = DeadLetterStore(redis.Redis.from_url(redis_server.url)).requeue("bulk-e")
    assert [p.put_back for p in plans] == [["u-1", "u-2"], ["u-1"]] and done.dropped == ("u-2",)
    assert _queued_requests(r) == {"u-1": 1}


def test_operators_racing_on_two_bulks_sharing_requests_queue_each_once(redis_server: EmbeddedRedis) -> None:
    """Two operators requeue two bulk entries sharing a request at the same moment. Old code: both queued it."""
    r = redis.Redis.from_url(redis_server.url)
    pairs = [(f"race-{i}-a", f"race-{i}-b", f"race-{i}-shared") for i in range(10)]
    for a, b, shared in pairs:
        _write(redis_server.url, _bulk(a, [f"{a}-own", shared]), a)
        _write(redis_server.url, _bulk(b, [shared, f"{b}-own"]), b)
    stores = [DeadLetterStore(redis.Redis.from_url(redis_server.url)) for _ in range(2)]
    for a, b, _ in pairs:
        outcomes = _race(lambda a=a: stores[0].requeue(a), lambda b=b: stores[1].requeue(b))  # type: ignore[misc]
        assert all(isinstance(o, tuple) for o in outcomes), outcomes
    queued = _queued_requests(r)
    assert set(queued.values()) == {1} and len(queued) == 30, queued
