"""The dead-letter ledger: each dead-lettered ID has one stored outcome and one listable entry; ``fleet dead-letter
requeue`` puts an entry back once and never where its ID already has an outcome; ``delete`` and ``purge`` remove
exactly what they say, with others at work beside them (real redis-server, real workers, the real CLI in process).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.dead_letter_writer import write_dead_letter
from broker.message_check import Refused
from producer.cli import main as fleet_main
from producer.client import FleetClient
from producer.deadletter import DeadLetterStore
from protocol.deadletter import Reason, encode_entry, make_entry, read_entry
from protocol.errors import FleetError, RequestNotFound
from protocol.keys import DEAD_LETTER_COUNTS_KEY, DEAD_LETTER_KEY, DELIVERIES_KEY, RESULT_KEY
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tests.queue_items import envelope, good_body, raw
from tools.processes import WorkerProcess, poll_until
from tools.redis_server import EmbeddedRedis

QUEUE = "fleet.demo-lm"
REQUEST = {"model": "demo-lm", "input_ids": [5, 6, 7], "output": {"top_k": 2}}


def _cli(capsys: pytest.CaptureFixture[str], config: Path, *argv: str) -> tuple[int, Any, str]:
    """``fleet dead-letter ...`` in this process: its exit code, the JSON it printed (or None), its stderr."""
    code = fleet_main(["dead-letter", argv[0], "--config", str(config), *argv[1:]])
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines else None, err


def _over_the_limit(task_id: str) -> bytes:
    """A good message that (as far as the counter knows) already killed 3 workers: the next take dead-letters it."""
    item = envelope(QUEUE, good_body(REQUEST), task_id=task_id)
    item["headers"]["redelivered"] = True
    item["properties"]["delivery_info"]["redelivered"] = True
    return raw(item)


def _two_copies_dead_lettered(
    fleet: Fleet, task_id: str
) -> tuple[Path, WorkerProcess, FleetClient, redis.Redis[bytes]]:
    """A worker, a client, and two copies of ``task_id`` past its delivery limit queued, waited for until both are
    dead-lettered: (the config, the worker, the client, a Redis client)."""
    cfg = fleet.config()
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    r.set(DELIVERIES_KEY.format(id=task_id), 3)
    r.lpush(QUEUE, _over_the_limit(task_id), _over_the_limit(task_id))
    poll_until(lambda: r.llen(DEAD_LETTER_KEY) == 2, 30, "both copies dead-lettered")
    return cfg, worker, client, r


def test_requeue_of_an_entry_whose_id_succeeded_through_another_copy_queues_nothing(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two copies of one request dead-lettered (``max_deliveries``): the first's FAILURE is stored, the second's is
    not (a stored outcome is kept). Requeueing the first runs the request to SUCCESS; the second entry then has
    nothing to requeue. Before, its requeue answered ``requeued: true`` (exit 0) and pushed the message again: a
    run that could store nothing, and, for a message that kills its workers, one more dead worker."""
    cfg, worker, client, r = _two_copies_dead_lettered(fleet, "twice-1")
    with pytest.raises(FleetError, match=r"dead-lettered \(max_deliveries\)"):
        client.result("twice-1", wait=True, timeout_s=10)
    code, listed, _ = _cli(capsys, cfg, "list")
    assert code == 0 and listed["count"] == 2
    first, second = [e["id"] for e in reversed(listed["entries"])]  # oldest first: its FAILURE is the stored one

    code, requeued, _ = _cli(capsys, cfg, "requeue", first)
    assert code == 0 and requeued["failures_cleared"] == 1, requeued
    result = client.result("twice-1", wait=True, timeout_s=30)
    assert isinstance(result, InferenceResult)
    stored = r.get(RESULT_KEY.format(id="twice-1"))
    poll_until(lambda: r.hlen("unacked") == 0 and r.llen(QUEUE) == 0, 30, "the requeued copy acked")
    worker.stop(timeout_s=15)  # from here on, what a requeue pushes stays on the queue to be seen

    code, refused, err = _cli(capsys, cfg, "requeue", second)
    assert code == 2, (refused, err)
    assert refused["type"] == "InvalidRequest" and refused["field"] == "id" and refused["limit"] == "SUCCESS"
    assert refused["message"].startswith("nothing to requeue: its request twice-1 already has an outcome stored")
    assert f"fleet dead-letter delete {second}" in refused["message"]
    assert r.llen(QUEUE) == 0 and r.get(RESULT_KEY.format(id="twice-1")) == stored
    code, forced, _ = _cli(capsys, cfg, "requeue", second, "--force")  # --force cannot make a run store anything
    assert code == 2 and forced["message"].startswith("nothing to requeue") and r.llen(QUEUE) == 0

    # the entry is kept until deleted, and the counts follow the entries
    code, listed, _ = _cli(capsys, cfg, "list")
    assert [e["id"] for e in listed["entries"]] == [second]
    code, deleted, _ = _cli(capsys, cfg, "delete", second)
    assert code == 0 and deleted == {"id": second, "deleted": True, "task_id": "twice-1", "reason": "max_deliveries",
                                     "remaining": 0}  # fmt: skip
    code, missing, _ = _cli(capsys, cfg, "delete", second)
    assert code == 1 and missing["type"] == "RequestNotFound"
    code, missing, _ = _cli(capsys, cfg, "requeue", second)
    assert code == 1 and missing["type"] == "RequestNotFound"
    assert r.hgetall(DEAD_LETTER_COUNTS_KEY) == {b"max_deliveries": b"2"}  # dead-letterings, not entries
    assert r.llen(DEAD_LETTER_KEY) == 0 and r.get(RESULT_KEY.format(id="twice-1")) == stored
    assert requeued["outcomes_kept"] == 0  # the first requeue's answer: no outcome was there to keep


@contextmanager
def _connection(url: str) -> Iterator[redis.Redis[bytes]]:
    client = redis.Redis.from_url(url)
    try:
        yield client
    finally:
        client.close()


def _write(url: str, task_id: str, reason: Reason = Reason.MAX_DELIVERIES) -> None:
    """What the worker's guard writes for a refused item (no result: no app configured)."""
    refused = Refused(reason, "deliveries", "delivered 3 times without an ack", "2", task_id, "fleet.infer", 4)
    write_dead_letter(lambda: _connection(url), None, QUEUE, QUEUE, _over_the_limit(task_id), refused)


def _race(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` in threads released together; each one's return value, or the exception it raised."""
    start = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        start.wait()
        try:
            out[i] = calls[i]()
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_operators_racing_on_one_entry_requeue_or_delete_it_once(redis_server: EmbeddedRedis) -> None:
    """Three requeues and a delete of each entry at once: one wins, the others are told it is gone; the queue holds
    each requeued message once, and nothing else."""
    r = redis.Redis.from_url(redis_server.url)
    ids = [f"race-{i}" for i in range(25)]
    for task_id in ids:
        _write(redis_server.url, task_id)
    stores = [DeadLetterStore(redis.Redis.from_url(redis_server.url)) for _ in range(4)]
    requeued, deleted = 0, 0
    for task_id in ids:
        outcomes = _race(*[lambda s=s, t=task_id: s.requeue(t) for s in stores[:3]],
                         lambda t=task_id: stores[3].delete(t))  # fmt: skip
        won = [o for o in outcomes if not isinstance(o, Exception)]
        assert len(won) == 1 and all(isinstance(o, RequestNotFound) for o in outcomes if o not in won), outcomes
        requeued += isinstance(won[0], tuple)
        deleted += not isinstance(won[0], tuple)
    queued = [json.loads(item)["headers"]["id"] for item in r.lrange(QUEUE, 0, -1)]
    assert len(queued) == requeued == len(set(queued)) and requeued + deleted == len(ids)
    assert r.llen(DEAD_LETTER_KEY) == 0 and r.hgetall(DEAD_LETTER_COUNTS_KEY) == {b"max_deliveries": b"25"}


def test_purge_removes_exactly_the_old_entries_while_workers_write_and_operators_delete(
    redis_server: EmbeddedRedis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    two_hours_ago = time.time() - 7200  # wall clock, as entries are stamped
    old = [make_entry(_over_the_limit(f"old-{i}"), reason=Reason.BAD_BODY, detail="d", field="body", queue=QUEUE,
                      list_key=QUEUE, now_unix_s=two_hours_ago, task_id=f"old-{i}") for i in range(300)]  # fmt: skip
    r.lpush(DEAD_LETTER_KEY, *[encode_entry(e) for e in old])
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(f"redis_url: {redis_server.url}\n")
    store = DeadLetterStore(redis.Redis.from_url(redis_server.url))

    def deletes() -> int:
        return sum(1 for e in old[::3] if _deleted(store, e.id))

    def writes() -> int:
        for i in range(100):
            _write(redis_server.url, f"new-{i}")
        return 100

    def purge() -> Any:
        code = fleet_main(["dead-letter", "purge", "--older-than", "3600", "--config", str(cfg)])
        return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    n_deleted, n_written, (code, purged) = _race(deletes, writes, purge)
    assert code == 0 and purged["purged"] + n_deleted == len(old), (purged, n_deleted)
    left = [read_entry(item) for item in r.lrange(DEAD_LETTER_KEY, 0, -1)]
    assert sorted(e.task_id or "" for e in left) == sorted(f"new-{i}" for i in range(n_written))


def _deleted(store: DeadLetterStore, ident: str) -> bool:
    try:
        store.delete(ident)
    except RequestNotFound:
        return False
    return True


_odd_items = st.one_of(
    st.binary(min_size=1, max_size=64),  # not JSON, not UTF-8
    st.binary(min_size=1, max_size=16).map(lambda b: b * 70_000),  # huge (up to 1.1 MB)
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=3).map(lambda d: json.dumps(d).encode()),
    st.sampled_from([b'{"schema_version": 1, "id": "hand-1", "reason": "max_deliveries", "detail": "", "queue": "q", '
                     b'"list_key": "q", "dead_lettered_at_unix_s": 1.0, "raw": "0008u", "raw_encoding": "base64"}']),
)  # fmt: skip


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(odd=st.lists(_odd_items, min_size=1, max_size=6), good=st.integers(0, 3))
def test_list_show_requeue_and_delete_answer_for_every_item_on_the_list(
    redis_server: EmbeddedRedis, tmp_path: Path, capsys: pytest.CaptureFixture[str], odd: list[bytes], good: int
) -> None:
    """Items that are not entries (not JSON, not UTF-8, huge, an entry's shape with a ``raw`` that does not decode)
    among real ones: ``list`` names each, ``show`` finds each, ``requeue`` of one with no queue is refused (exit 2,
    nothing pushed), ``delete`` removes each once. Before, an entry whose ``raw`` did not decode failed ``requeue``
    with ``unexpected Error`` (exit 1), and ``requeue --force`` of an item with no routing key pushed it onto a
    list named ``unknown`` that no worker reads (exit 0)."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(f"redis_url: {redis_server.url}\n")
    r.lpush(DEAD_LETTER_KEY, *odd)
    for i in range(good):
        _write(redis_server.url, f"good-{i}")
    code, listed, _ = _cli(capsys, cfg, "list", "--limit", "0")
    assert code == 0 and listed["count"] == len(odd) + good == len(listed["entries"])
    for shown in listed["entries"]:
        code, doc, err = _cli(capsys, cfg, "show", shown["id"])
        assert code == 0 and doc["id"] == shown["id"], err
        if not (shown["task_id"] or "").startswith("good-"):  # none of these names a queue
            code, doc, err = _cli(capsys, cfg, "requeue", shown["id"], "--force")
            assert code == 2 and doc["field"] == "queue", (shown, doc, err)
    assert r.keys("unknown") == [] and r.llen(DEAD_LETTER_KEY) == len(odd) + good
    for shown in listed["entries"]:
        code, doc, err = _cli(capsys, cfg, "delete", shown["id"])
        assert code == 0 or (code == 1 and doc["type"] == "RequestNotFound"), err  # an item listed twice: one ID
    assert r.llen(DEAD_LETTER_KEY) == 0
