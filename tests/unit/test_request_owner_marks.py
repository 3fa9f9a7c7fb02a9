"""Request owner marks, the pure parts (:mod:`gateway.request_owners`, :mod:`producer.worker_readiness`): the
owner each accepted caller's rate bucket names, the refusal's words, nothing touched while auth is off, and
a submit group where one item holds another key's ID (a stand-in for Redis and for the group's send)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import pytest
import redis
from prometheus_client import CollectorRegistry

from gateway.auth import OPEN_OWNER, owner_of
from gateway.request_owners import RequestOwners, foreign, taken
from gateway.submit_queue import SubmitQueue
from producer.admission import rate_key_for
from producer.submit_groups import SubmitItem
from producer.worker_readiness import not_ready_reasons
from protocol.errors import IdempotencyConflict, QueueFull
from protocol.messages import InferenceRequest

KEYS = [b"key-a", b"key-b"]
NOWHERE = redis.Redis(port=1, socket_connect_timeout=0.01)
"""A client that reaches no Redis: a call that used it would raise ConnectionError."""


def test_each_accepted_callers_bucket_names_its_keys_owner() -> None:
    owners = RequestOwners(NOWHERE, KEYS, 600)
    assert owners.owner_for(rate_key_for("key-a")) == owner_of("key-a", KEYS)
    assert owners.owner_for(rate_key_for("key-b")) == owner_of("key-b", KEYS)
    with pytest.raises(KeyError):  # a bucket no configured key has owns nothing: never the open owner
        owners.owner_for(rate_key_for("not-a-key"))


def test_with_auth_off_nothing_is_written_or_read() -> None:
    owners = RequestOwners(NOWHERE, [], 600)
    owner = owners.owner_for(rate_key_for(None))
    assert owner == OPEN_OWNER
    assert owners.claim(["r1"], [owner]) == []
    assert owners.claim_each(["r1"], [owner]) == ([], [])
    assert owners.readable("r1", owner)
    owners.keep_with_result("r1", owner)


def test_the_refusal_says_the_same_whatever_the_body_and_names_the_field() -> None:
    refused = taken("order-1")
    assert isinstance(refused, IdempotencyConflict) and refused.field == "request_id"
    assert "order-1" in refused.message and "different body" not in refused.message
    assert taken("order-1", "requests[2]").field == "requests[2].request_id"


@pytest.mark.parametrize(("stored", "refused"), [(None, False), (b"own", False), (b"other", True), (b"", True)])
def test_only_a_mark_naming_another_owner_is_foreign(stored: bytes | None, refused: bool) -> None:
    assert foreign(stored, "own") is refused


class _Owners:
    """Stand-in for :class:`RequestOwners` with Redis: claims every position, finds ``held`` taken."""

    def __init__(self, held: set[str]) -> None:
        self.held = held
        self.released: list[str] = []

    def owner_for(self, rate_key: str | None) -> str:
        return f"owner-of-{rate_key}"

    def claim_each(self, ids: Sequence[str], owners: Sequence[str]) -> tuple[list[int], list[int]]:
        return [i for i, rid in enumerate(ids) if rid not in self.held], [
            i for i, rid in enumerate(ids) if rid in self.held
        ]

    def release(self, ids: Sequence[str], owners: Sequence[str], positions: Iterable[int]) -> None:
        self.released += [ids[i] for i in positions]


def _item(tag: str, count: int = 1) -> SubmitItem:
    return SubmitItem([InferenceRequest(model="m", input_ids=[1, i + 1], request_id=f"{tag}-{i}")
                       for i in range(count)], rate_key=tag)  # fmt: skip


def test_a_group_item_holding_another_keys_id_is_refused_alone_and_refused_items_release_their_marks() -> None:
    sent: list[list[str]] = []

    def send_group(items: Sequence[SubmitItem]) -> list[list[str] | BaseException]:
        sent.append([str(it.requests[0].request_id) for it in items])
        return [QueueFull("full", "max_queue_depth", 1, 1.0) if it.rate_key == "full"
                else [str(r.request_id) for r in it.requests] for it in items]  # fmt: skip

    owners = _Owners(held={"taken-1"})
    queue = SubmitQueue(send_group, max_group_requests=64, registry=CollectorRegistry(),
                        owners=owners)  # type: ignore[arg-type]  # fmt: skip
    items = [_item("ok", 2), _item("taken", 2), _item("full")]
    outcomes = queue._send_owned(items)
    assert outcomes[0] == ["ok-0", "ok-1"]
    assert isinstance(outcomes[1], IdempotencyConflict) and "taken-1" in outcomes[1].message
    assert isinstance(outcomes[2], QueueFull)
    assert sent == [["ok-0", "full-0"]]  # the refused item never reached the send
    assert sorted(owners.released) == ["full-0", "taken-0"]  # the ok item's marks stay; taken-1 was never ours


def test_a_queue_without_owners_sends_as_before() -> None:
    async def main() -> list[str]:
        queue = SubmitQueue(lambda items: [[str(r.request_id) for r in it.requests] for it in items],
                            max_group_requests=8, registry=CollectorRegistry())  # fmt: skip
        return await queue.submit(_item("plain"))

    assert asyncio.run(main()) == ["plain-0"]


def test_each_worker_that_is_not_ready_is_named_with_its_reason() -> None:
    beats = [
        {"hostname": "w1", "ready": True},
        {"hostname": "w2", "ready": False, "not_ready": "thread fleet-scheduler died"},
        {"hostname": "w3", "ready": False, "shutting_down": True},
        {"hostname": "w4", "ready": False},
    ]
    assert not_ready_reasons(beats) == [
        "worker 'w2' is not ready: thread fleet-scheduler died",
        "worker 'w3' is shutting down (draining what it holds; it takes nothing new)",
        "worker 'w4' is alive but not ready (loading or warming up)",
    ]
