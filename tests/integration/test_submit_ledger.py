"""The ledger on the plain Celery bulk face: every request ID a ``fleet.infer_bulk`` message names ends in exactly
one stored terminal state, the first item under an ID is the request, and nothing stored ever changes.

Real redis-server, one real ``celery worker`` of the demo LM, a plain ``Celery`` app as the producer (what the
README's "Any Celery client" section promises): it writes no submit markers and may send anything.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import redis
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.client import FleetClient
from protocol.errors import InvalidRequest
from protocol.keys import REQUEST_ID_PATTERN, WORKER_KEY_PREFIX
from protocol.messages import MAX_BULK_REQUESTS, InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import wait_until
from tools.ledger import Ledger

MODEL = "demo-lm"
QUEUE = "fleet.demo-lm"
READY = ("SUCCESS", "FAILURE", "REVOKED")


def _stored(r: redis.Redis[bytes], request_id: str) -> dict[str, Any] | None:
    raw = r.get(f"celery-task-meta-{request_id}")
    return json.loads(raw) if raw else None


def test_an_id_named_twice_in_one_bulk_message_runs_once_and_another_body_is_refused(fleet: Fleet) -> None:
    """Before, both items ran, the first's result was stored, and the summary counted the second body as
    ``succeeded``: a plain Celery producer was never told its second body was dropped (and an item without an
    ID was only counted, never named)."""
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    message = {"requests": [
        {"request_id": "twice", "model": MODEL, "input_ids": [5, 6]},
        {"request_id": "twice", "model": MODEL, "input_ids": [7, 8, 9]},  # another body: refused, not run
        {"request_id": "same", "model": MODEL, "input_ids": [5, 6, 7, 8]},
        {"request_id": "same", "model": MODEL, "input_ids": [5, 6, 7, 8], "submitted_at_unix_s": 1.0},  # same request
        {"model": MODEL, "input_ids": [5]},  # no ID: refused, named by its position
    ]}  # fmt: skip
    try:
        summary = plain.send_task("fleet.infer_bulk", args=[message], queue=QUEUE).get(timeout=60)
        twice, same = client.wait(["twice", "same"], 10)
        assert isinstance(twice, InferenceResult) and twice.input_tokens == 2  # the first body's result
        assert isinstance(same, InferenceResult) and same.input_tokens == 4
        assert summary["count"] == 5 and summary["succeeded"] == 3, summary
        assert summary["outcomes"] == {"succeeded": 3, "invalid": 2}, summary
        refused = {entry["index"]: entry for entry in summary.get("refused", [])}
        assert sorted(refused) == [1, 4], summary
        assert refused[1]["type"] == "IdempotencyConflict" and refused[1]["field"] == "requests[1].request_id"
        assert refused[1]["request_id"] == "twice" and "requests[0]" in refused[1]["message"]
        assert refused[4]["type"] == "DecodeError" and refused[4]["field"] == "requests[4].request_id"
        assert refused[4]["request_id"] is None

        # the same message again (a resend): nothing stored changes, byte for byte
        before = {rid: r.get(f"celery-task-meta-{rid}") for rid in ("twice", "same")}
        plain.send_task("fleet.infer_bulk", args=[message], queue=QUEUE).get(timeout=60)
        assert {rid: r.get(f"celery-task-meta-{rid}") for rid in ("twice", "same")} == before
    finally:
        plain.close()


def test_a_bulk_message_over_the_limit_fails_each_request_it_names(fleet: Fleet) -> None:
    """Before, the message's own task failed and the 4,097 request IDs it named never got any state: a caller
    polling them by ID (``FleetClient.wait``, ``GET /v1/requests/{id}``) read ``not_found`` until it gave up."""
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    ids = [f"over-{i}" for i in range(MAX_BULK_REQUESTS + 1)]
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    try:
        sent = plain.send_task("fleet.infer_bulk", queue=QUEUE, args=[{"requests": [
            {"request_id": rid, "model": MODEL, "input_ids": [5, 6]} for rid in ids]}])  # fmt: skip
        try:
            sent.get(timeout=60)
            raise AssertionError("an over-limit bulk message ran")
        except InvalidRequest as exc:
            assert exc.field == "requests" and exc.limit == MAX_BULK_REQUESTS
    finally:
        plain.close()
    ledger = Ledger(r, queues=[QUEUE])
    for rid in ids:
        ledger.accepted(rid)
    report = ledger.check_settled(30)
    assert report.ok, report.as_dict()
    outcomes = client.wait(ids, 10)
    assert all(isinstance(o, InvalidRequest) and o.field == "requests" and o.limit == MAX_BULK_REQUESTS
               for o in outcomes), {type(o).__name__ for o in outcomes}  # fmt: skip


def _in_flight(r: redis.Redis[bytes], hostname: str) -> int:
    raw = r.get(WORKER_KEY_PREFIX + hostname)
    return int(json.loads(raw)["in_flight"]) if raw else 0


def test_a_bulk_message_held_by_a_sigkilled_worker_is_served_once_by_another(fleet: Fleet) -> None:
    """Two workers; the one that takes a bulk message holds it in its batch window (5 requests, batches of 8,
    a long window) and is SIGKILLed there: the other serves every request of it, each ID once, and a resend
    of the message afterwards changes nothing stored."""
    cfg = fleet.config(visibility_timeout_s=5, worker={"heartbeat_s": 0.5},
                       models={MODEL: {"batching": {"max_wait_ms": 3000, "close_when_idle": False}}})  # fmt: skip
    workers = [fleet.worker(cfg, wait=False), fleet.worker(cfg, wait=False)]
    for w in workers:
        w.wait_ready(120)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    ids = [f"killed-{i}" for i in range(5)]
    message = {"requests": [{"request_id": rid, "model": MODEL, "input_ids": [5, 6 + i]} for i, rid in enumerate(ids)]}
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    try:
        plain.send_task("fleet.infer_bulk", args=[message], queue=QUEUE)
        holder = wait_until(lambda: next((w for w in workers if _in_flight(r, w.hostname) == 5), None), 30,
                            "a worker holding the bulk message")  # fmt: skip
        assert all(_stored(r, rid) is None for rid in ids)  # killed before any result was stored
        holder.kill()
        ledger = Ledger(r, queues=[QUEUE])
        for rid in ids:
            ledger.accepted(rid)
        report = ledger.check_settled(60)
        assert report.ok and report.terminal == {"SUCCESS": 5}, report.as_dict()
        results = client.wait(ids, 10)
        other = next(w for w in workers if w is not holder)
        assert all(isinstance(x, InferenceResult) and x.timings.worker == other.hostname for x in results)
        before = {rid: r.get(f"celery-task-meta-{rid}") for rid in ids}
        plain.send_task("fleet.infer_bulk", args=[message], queue=QUEUE).get(timeout=60)
        assert {rid: r.get(f"celery-task-meta-{rid}") for rid in ids} == before
    finally:
        plain.close()


# -- fuzzed bulk messages: mixed valid and invalid items, repeated and unusable IDs ---------------------------------

_VALID_IDS = st.lists(st.integers(0, 511), min_size=1, max_size=6)
_BAD_IDS = st.sampled_from([[], [70_000], [1, -1], ["a"], [[5]], [True], None])
_ID = st.one_of(st.sampled_from(["a", "b", "c", "A.b:c-d_e", "z" * 120, "z" * 128, "a b"]),
                st.sampled_from([None, "", 7, ["a"]]))  # with its "m<n>-" prefix "z" * 128 breaks the ID rule


@st.composite
def _item(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 19)) == 0:
        return draw(st.sampled_from(["text", 5, None, [1, 2]]))  # not an object at all
    item: dict[str, Any] = {"model": MODEL, "output": {"top_k": draw(st.sampled_from([1, 3, 3, 0, 10_000]))}}
    rid = draw(_ID)
    if rid is not None:
        item["request_id"] = rid
    ids = draw(st.one_of(_VALID_IDS, _VALID_IDS, _BAD_IDS))
    if ids is not None:
        item["input_ids"] = ids
    if draw(st.integers(0, 9)) == 0:
        item["extra"] = {"nested": [1, {"deeper": True}]}  # unknown field: refused naming it
    return item


def _valid(item: dict[str, Any]) -> bool:
    ids, top_k = item.get("input_ids"), item["output"]["top_k"]
    return (
        "extra" not in item
        and isinstance(ids, list)
        and bool(ids)
        and all(type(t) is int and 0 <= t < 512 for t in ids)
        and 1 <= top_k <= 64
    )


def _expected(items: list[Any]) -> tuple[dict[str, dict[str, Any]], set[int]]:
    """Per usable ID its first item (the request), and the positions the summary must list as refused."""
    first: dict[str, dict[str, Any]] = {}
    refused: set[int] = set()
    for pos, item in enumerate(items):
        rid = item.get("request_id") if isinstance(item, dict) else None
        if not isinstance(rid, str) or not re.fullmatch(REQUEST_ID_PATTERN, rid):  # no usable ID: named by position
            refused.add(pos)
            continue
        body = {k: v for k, v in item.items() if k != "request_id"}
        if rid not in first:
            first[rid] = item
        elif {k: v for k, v in first[rid].items() if k != "request_id"} != body:
            refused.add(pos)
    return first, refused


_messages = itertools.count()


def test_fuzzed_bulk_messages_keep_the_ledger(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    client: FleetClient = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)

    @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_item(), min_size=1, max_size=12))
    def check(drawn: list[Any]) -> None:
        n = next(_messages)  # fresh IDs per message: a stored outcome of an earlier example never changes
        items = [{**i, "request_id": f"m{n}-{i['request_id']}"} if isinstance(i, dict) and isinstance(
            i.get("request_id"), str) and i["request_id"] else i for i in drawn]  # fmt: skip
        summary = plain.send_task("fleet.infer_bulk", args=[{"requests": items}], queue=QUEUE).get(timeout=60)
        first, refused = _expected(items)
        assert summary["count"] == len(items) and summary["succeeded"] + summary["failed"] == len(items), summary
        assert {e["index"] for e in summary.get("refused", [])} == refused, summary
        for entry in summary.get("refused", []):
            assert entry["field"] == f"requests[{entry['index']}].request_id", entry
        outcomes = dict(zip(first, client.wait(list(first), 10), strict=True))
        for rid, item in first.items():
            meta = _stored(r, rid)
            assert meta is not None and meta["status"] in READY, (rid, meta)
            outcome = outcomes[rid]
            if _valid(item):
                assert isinstance(outcome, InferenceResult), (item, outcome)
                assert outcome.input_tokens == len(item["input_ids"]) and outcome.request_id == rid
                assert outcome.top_k is not None and len(outcome.top_k) == item["output"]["top_k"]
            else:
                assert isinstance(outcome, InvalidRequest) and outcome.field, (item, outcome)
        before = {rid: r.get(f"celery-task-meta-{rid}") for rid in first}
        plain.send_task("fleet.infer_bulk", args=[{"requests": list(reversed(items))}], queue=QUEUE).get(timeout=60)
        assert {rid: r.get(f"celery-task-meta-{rid}") for rid in first} == before  # nothing stored changes

    try:
        check()
    finally:
        plain.close()
