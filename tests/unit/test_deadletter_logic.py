"""Dead-letter entries, requeue rules and delivery counting, without Redis."""

from __future__ import annotations

import json
from typing import Any

import pytest

from broker.deliveries import count_delivery, count_ttl_s, over_limit
from producer.deadletter import fresh_delivery
from protocol.deadletter import Reason, decode_entry, encode_entry, make_entry, read_entry, requeue_allowed
from protocol.errors import DecodeError
from protocol.keys import DELIVERIES_KEY
from tests.queue_items import envelope, good_body, raw


def _entry(item: bytes, reason: Reason = Reason.BAD_BODY) -> Any:
    return make_entry(item, reason=reason, detail="why", field="body", queue="fleet.demo-lm",
                      list_key="fleet.demo-lm", now_unix_s=1_700_000_000.5, task_id="t-1", task="fleet.infer")


@pytest.mark.parametrize(("item", "encoding"), [(b'{"a": 1}', "utf-8"), (b"\xff\x00\x80 binary", "base64"),
                                                (b"", "utf-8")])
def test_entries_keep_the_item_byte_for_byte(item: bytes, encoding: str) -> None:
    entry = _entry(item)
    assert entry.raw_encoding == encoding and entry.raw_bytes() == item
    again = decode_entry(encode_entry(entry))
    assert again == entry and again.raw_bytes() == item
    assert again.summary()["reason"] == "bad_body" and again.summary()["id"] == entry.id


def test_each_entry_has_its_own_id() -> None:
    assert _entry(b"x").id != _entry(b"x").id


def test_a_bad_entry_names_what_broke() -> None:
    with pytest.raises(DecodeError) as info:
        decode_entry(json.dumps({"schema_version": 1, "id": "x"}).encode())
    assert info.value.field in {"reason", "detail", "queue", "list_key", "dead_lettered_at_unix_s", "raw"}


def test_items_from_older_workers_read_as_legacy_entries() -> None:
    item = raw(envelope("fleet.demo-lm", b"nope"))
    entry = read_entry(item)
    assert entry.reason is Reason.LEGACY and entry.queue == "fleet.demo-lm" and entry.raw_bytes() == item
    assert entry.id == read_entry(item).id and entry.id.startswith("legacy-")  # stable: show/requeue find it
    assert read_entry(b"\xff garbage").queue == "unknown"


@pytest.mark.parametrize(
    ("reason", "allowed"),
    [(Reason.MAX_DELIVERIES, True), (Reason.UNKNOWN_TASK, True), (Reason.BAD_BODY, False), (Reason.PICKLE, False),
     (Reason.NOT_JSON, False), (Reason.BODY_NOT_JSON, False), (Reason.BAD_HEADERS, False), (Reason.LEGACY, False),
     (Reason.WORKER_ERROR, False), (Reason.ETA_BEYOND_VISIBILITY, False)],  # an ETA's: see test_eta_window
)
def test_only_messages_a_worker_would_take_requeue_without_force(reason: Reason, allowed: bool) -> None:
    assert requeue_allowed(reason, "fleet.infer_v2") is allowed


@pytest.mark.parametrize(("task", "allowed"), [
    ("fleet.infer_v2", True),  # a newer worker may know it
    ("celery.backend_cleanup", False),  # every worker refuses it again (requeued without --force, it came back)
    ("tasks.add", False),
    (None, False),
])  # fmt: skip
def test_an_unknown_task_requeues_without_force_only_when_it_is_a_fleet_task(task: str | None, allowed: bool) -> None:
    assert requeue_allowed(Reason.UNKNOWN_TASK, task) is allowed


def test_a_requeued_message_loses_its_redelivered_marks() -> None:
    doc = envelope("fleet.demo-lm", good_body({"model": "demo-lm", "input_ids": [1]}), task_id="t")
    plain = raw(doc)
    assert fresh_delivery(plain) == plain  # nothing to drop: byte for byte
    doc["headers"]["redelivered"] = True
    doc["properties"]["delivery_info"]["redelivered"] = True
    fresh = json.loads(fresh_delivery(raw(doc)))
    assert "redelivered" not in fresh["headers"] and "redelivered" not in fresh["properties"]["delivery_info"]
    assert fresh["body"] == doc["body"] and fresh["headers"]["id"] == "t"
    assert fresh_delivery(b"\xff not json") == b"\xff not json"


@pytest.mark.parametrize(("deliveries", "limit", "over"), [(1, 1, False), (2, 1, True), (3, 3, False), (4, 3, True)])
def test_over_limit(deliveries: int, limit: int, over: bool) -> None:
    assert over_limit(deliveries, limit) is over


def test_count_ttl_spans_every_redelivery() -> None:
    assert count_ttl_s(visibility_timeout_s=3600, result_ttl_s=3600, max_deliveries=3) == 4 * 3600 + 3600


class FakeRedis:
    """Just the pipeline commands count_delivery sends."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.ttls: dict[str, int] = {}
        self.calls = 0

    def pipeline(self, transaction: bool = True) -> FakeRedis:
        self.calls += 1
        self._ops: list[Any] = []
        return self

    def set(self, key: str, value: int, nx: bool = False) -> None:
        self._ops.append(("set", key, value, nx))

    def incr(self, key: str) -> None:
        self._ops.append(("incr", key))

    def expire(self, key: str, ttl: int) -> None:
        self._ops.append(("expire", key, ttl))

    def execute(self) -> list[Any]:
        out: list[Any] = []
        for op in self._ops:
            if op[0] == "set":
                fresh = op[1] not in self.values
                if fresh or not op[3]:
                    self.values[op[1]] = op[2]
                out.append(fresh)
            elif op[0] == "incr":
                self.values[op[1]] = self.values.get(op[1], 0) + 1
                out.append(self.values[op[1]])
            else:
                self.ttls[op[1]] = op[2]
                out.append(True)
        return out


def test_first_deliveries_cost_no_round_trip_and_redeliveries_count_from_two() -> None:
    fake = FakeRedis()
    assert count_delivery(fake, "t", redelivered=False, ttl_s=60) == 1
    assert fake.calls == 0
    assert [count_delivery(fake, "t", redelivered=True, ttl_s=60) for _ in range(3)] == [2, 3, 4]
    assert fake.values == {DELIVERIES_KEY.format(id="t"): 4} and fake.ttls == {DELIVERIES_KEY.format(id="t"): 60}
