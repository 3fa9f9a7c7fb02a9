"""A gateway submit claims its owner mark in one Redis step and queues in the next: a ``FleetClient`` (no key) that
queues the same caller-given ID with the same body in between keeps its request every key's. Real redis-server,
the gateway app in process (keys a and b), no worker (the requests stay queued).

Reported (``gateway/request_owners.py``'s known limit): the gateway's queue step found the ID known (the same
request, not queued again) and the mark it had claimed stayed on the client's request, which became key a's alone:
key b was told it does not exist (404). Now the queue step deletes a mark its call claimed where the submit marker
does not say an owner's call queued the ID (``"owned": true``), in the same Redis step; a call of the same key
that queued it in between wrote ``owned``, and the mark stays. A hook between the two steps makes the race happen
on every run.
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.auth import owner_of
from gateway.request_owners import RequestOwners
from producer.client import FleetClient
from producer.task_writer import owners_in_messages
from protocol.keys import OWNER_KEY, REQUEST_KEY
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet

pytestmark = pytest.mark.timeout(120)

KEY_A = "one-step-key-a"
KEY_B = "one-step-key-b"
A = {"X-API-Key": KEY_A}
B = {"X-API-Key": KEY_B}
MODEL = "demo-lm"
IDS = [5, 6, 7]
OWNER_A = owner_of(KEY_A, [KEY_A.encode(), KEY_B.encode()])


class Between:
    """Runs ``intruder`` once, right after the gateway's owner claim of ``request_id`` and before its queue step."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.request_id = ""
        self.intruder: Callable[[], Any] = lambda: None
        self.fired = 0
        claim_each = RequestOwners.claim_each

        def hooked(owners: RequestOwners, ids: Sequence[str], marks: Sequence[str]) -> tuple[list[int], list[int]]:
            found = claim_each(owners, ids, marks)
            if self.request_id in ids and not self.fired:
                self.fired += 1
                contextvars.Context().run(self.intruder)  # none of the gateway call's context (its owners)
            return found

        monkeypatch.setattr(RequestOwners, "claim_each", hooked)


@pytest.fixture(params=["writer", "send_task", "rate_limited"])
def served(request: pytest.FixtureRequest, fleet: Fleet,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, FleetClient, Between]]:  # fmt: skip
    """The gateway app and another client on the same Redis, the hook installed. The gateway queues through the
    task writer (the script queues), ``send_task`` (the script claims, Celery queues) or, with a rate limit, looks
    a known ID up before admission (``FleetClient.send``'s look-up, outside the script)."""
    rate = {"rate_capacity": 100, "rate_refill_per_s": 100} if request.param == "rate_limited" else {}
    cfg = fleet.config(api={"api_keys": [KEY_A, KEY_B]}, admission=rate)
    settings = load_settings(cfg)
    gateway_client = FleetClient(settings)
    if request.param == "send_task":
        gateway_client.writer._usable = False  # the same client, through Celery's send_task
    between = Between(monkeypatch)
    with TestClient(create_app(settings, gateway_client)) as http:
        yield http, fleet.client(cfg), between


Served = tuple[TestClient, FleetClient, Between]


def _mark(client: FleetClient, rid: str) -> bytes | None:
    mark: bytes | None = client.redis.get(OWNER_KEY.format(id=rid))
    return mark


def test_a_fleet_client_queueing_the_id_between_claim_and_queue_keeps_it_every_keys(served: Served) -> None:
    http, other, between = served
    rid = between.request_id = f"between-{uuid.uuid4().hex}"
    between.intruder = lambda: other.submit(MODEL, IDS, request_id=rid)
    answer = http.post("/v1/requests", headers=A, json={"model": MODEL, "input_ids": IDS, "request_id": rid})
    assert between.fired == 1
    assert answer.status_code == 202 and answer.json()["request_id"] == rid, answer.text  # the same request
    assert _mark(other, rid) is None  # before: a's mark on the client's request
    seen = http.get(f"/v1/requests/{rid}", headers=B)
    assert seen.status_code == 200 and seen.json()["status"] == "queued", seen.text  # before: 404
    assert other.redis.llen(other.settings.queue_for(MODEL)) == 1  # queued once, by the client


def test_a_batch_keeps_the_marks_of_what_it_queued_and_drops_the_one_queued_between(served: Served) -> None:
    http, other, between = served
    raced = between.request_id = f"raced-{uuid.uuid4().hex}"
    fresh = f"fresh-{uuid.uuid4().hex}"
    between.intruder = lambda: other.submit(MODEL, IDS, request_id=raced)
    answer = http.post("/v1/requests:batch", headers=A,
                       json={"requests": [{"model": MODEL, "input_ids": IDS, "request_id": raced},
                                          {"model": MODEL, "input_ids": [8, 9], "request_id": fresh}]})  # fmt: skip
    assert between.fired == 1
    assert answer.status_code == 202, answer.text
    assert _mark(other, raced) is None and _mark(other, fresh) == OWNER_A.encode()
    assert http.get(f"/v1/requests/{raced}", headers=B).status_code == 200  # before: 404
    assert http.get(f"/v1/requests/{fresh}", headers=B).status_code == 404  # a's own request
    assert other.redis.llen(other.settings.queue_for(MODEL)) == 2


def test_a_call_of_the_same_key_queueing_the_id_between_keeps_the_mark(served: Served) -> None:
    """Two calls of key a race on one ID: the second one's claim found a's mark, it queued the request (its task
    message naming a's owner) between the first one's claim and queue step. The mark stays: the request is a's.
    (Right before too: the mark was never deleted; this keeps it so now that marks can be.)"""
    http, other, between = served
    rid = between.request_id = f"same-key-{uuid.uuid4().hex}"

    def same_key() -> None:
        with owners_in_messages({rid: OWNER_A}):  # as the gateway's second call queues it (its claim: none now)
            other.submit(MODEL, IDS, request_id=rid)

    between.intruder = same_key
    answer = http.post("/v1/requests", headers=A, json={"model": MODEL, "input_ids": IDS, "request_id": rid})
    assert between.fired == 1 and answer.status_code == 202, answer.text
    assert _mark(other, rid) == OWNER_A.encode()
    assert http.get(f"/v1/requests/{rid}", headers=B).status_code == 404
    assert http.get(f"/v1/requests/{rid}", headers=A).json()["status"] == "queued"


def test_the_marker_of_an_owned_request_says_so_and_a_fleet_clients_does_not(served: Served) -> None:
    http, other, _ = served
    owned = http.post("/v1/requests", headers=A, json={"model": MODEL, "input_ids": IDS}).json()["request_id"]
    plain = other.submit(MODEL, IDS)
    markers: list[Any] = other.redis.mget([REQUEST_KEY.format(id=owned), REQUEST_KEY.format(id=plain)])
    assert b'"owned": true' in markers[0] and b"owned" not in markers[1], markers
