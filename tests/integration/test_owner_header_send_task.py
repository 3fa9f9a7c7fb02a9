"""Where tasks go through Celery's ``send_task`` (a broker with kombu's ``global_keyprefix``: the task writer
unusable), the gateway's task messages carry their requests' owners too (``fleet_owners`` header), so a worker
writes back an owner mark Redis lost. Real redis-server, real demo-lm worker subprocess, the gateway app in process.

Reported: ``TaskWriter.build`` added the header, the ``send_task`` paths of ``FleetClient`` (``send``,
``send_batch``) and of ``submit_bulk`` did not; a mark lost while such a request waited was never written back,
and once its result was stored any API key read it (200). Now the same header goes to ``send_task(headers=...)``,
which Celery adds to the message's headers, and another key gets the 404 of an unknown ID.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from broker import make_celery
from gateway.app import create_app
from gateway.auth import owner_of
from producer.client import FleetClient
from producer.task_writer import owners_in_messages
from protocol.celeryconf import celery_config
from protocol.keys import OWNER_KEY, OWNERS_HEADER
from protocol.messages import BULK_TASK_NAME, TASK_NAME
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import wait_until

pytestmark = pytest.mark.timeout(300)

KEY_A = "header-key-a"
KEY_B = "header-key-b"
MODEL = "demo-lm"
PREFIX = "pfx:"
"""The broker's ``global_keyprefix`` in the key-prefix test."""


def _headers(raw: bytes) -> dict[str, Any]:
    headers: dict[str, Any] = json.loads(raw)["headers"]
    return headers


def test_a_key_prefix_broker_sends_the_owners_header_through_send_task(fleet: Fleet) -> None:
    """A client on a broker with ``global_keyprefix`` (the task writer unusable) sends a single task, a batch and a
    bulk message inside :func:`owners_in_messages`: each message in the prefixed queue names the owners of the
    requests it carries, and only those (before: no ``fleet_owners`` header at all)."""
    settings = load_settings(fleet.config())
    conf = celery_config(settings)
    conf["broker_transport_options"] = {**conf["broker_transport_options"], "global_keyprefix": PREFIX}
    client = FleetClient(settings, make_celery(conf, "prefixed-producer"))
    r = redis.Redis.from_url(fleet.redis_url)
    try:
        assert not client.writer.usable()
        one, two, three, bulk = (f"{name}-{uuid.uuid4().hex}" for name in ("one", "two", "three", "bulk"))
        owners = {one: "owner-a", two: "owner-a", bulk: "owner-b"}
        with owners_in_messages(owners):
            client.submit(MODEL, [5, 6], request_id=one)
            client.send_batch([client.build_request(MODEL, [7], request_id=two),
                               client.build_request(MODEL, [8], request_id=three)])  # fmt: skip
            client.submit_bulk(MODEL, [[9], [10]], request_ids=[bulk, f"free-{uuid.uuid4().hex}"])
        queue = PREFIX + settings.queue_for(MODEL)
        sent = [_headers(raw) for raw in reversed(r.lrange(queue, 0, -1))]  # LPUSH: oldest last
        assert [h["task"] for h in sent] == [TASK_NAME, TASK_NAME, TASK_NAME, BULK_TASK_NAME], sent
        assert [h.get(OWNERS_HEADER) for h in sent] == [{one: "owner-a"}, {two: "owner-a"}, None, {bulk: "owner-b"}]
        assert r.llen(settings.queue_for(MODEL)) == 0  # nothing outside the prefix
    finally:
        client.close()
        r.close()


@pytest.fixture
def gateway(fleet: Fleet) -> Iterator[tuple[TestClient, FleetClient]]:
    """The gateway app (keys a and b) on a client that queues through ``send_task`` (its writer unusable, as on a
    key-prefix broker, whose lists a worker started from settings would not read); no worker yet."""
    settings = load_settings(fleet.config(api={"api_keys": [KEY_A, KEY_B]}))
    client = FleetClient(settings)
    client.writer._usable = False  # the same client, through Celery's send_task
    with TestClient(create_app(settings, client)) as http:
        yield http, client


def test_a_mark_lost_while_queued_through_send_task_is_written_back(
    fleet: Fleet, gateway: tuple[TestClient, FleetClient]
) -> None:
    """A's requests (alone with a caller-given ID, a batch, a grouped submit, a bulk message) queued through
    ``send_task`` lose their marks before any worker runs; the worker stores each result with A's mark again and B
    is told each does not exist (before: 200 and A's result)."""
    http, client = gateway
    a, b = {"X-API-Key": KEY_A}, {"X-API-Key": KEY_B}
    owner_a = owner_of(KEY_A, [KEY_A.encode(), KEY_B.encode()])
    alone = http.post("/v1/requests", headers=a, json={"model": MODEL, "input_ids": [5, 6],
                                                       "request_id": f"alone-{uuid.uuid4().hex}"})  # fmt: skip
    batch = http.post("/v1/requests:batch", headers=a,
                      json={"requests": [{"model": MODEL, "input_ids": [7]}, {"model": MODEL, "input_ids": [8]}]})
    grouped = http.post("/v1/requests", headers=a, json={"model": MODEL, "input_ids": [9]})
    assert {alone.status_code, batch.status_code, grouped.status_code} == {202}, (alone.text, batch.text, grouped.text)
    bulk_ids = [f"bulk-{uuid.uuid4().hex}" for _ in range(2)]
    with owners_in_messages({rid: owner_a for rid in bulk_ids}):
        client.submit_bulk(MODEL, [[10], [11]], request_ids=bulk_ids)
    ids = [alone.json()["request_id"], *(x["request_id"] for x in batch.json()["requests"]),
           grouped.json()["request_id"], *bulk_ids]  # fmt: skip
    r = redis.Redis.from_url(fleet.redis_url)
    try:
        assert all(r.get(OWNER_KEY.format(id=rid)) == owner_a.encode() for rid in ids[:4])
        r.delete(*(OWNER_KEY.format(id=rid) for rid in ids))  # as a Redis restart without persistence would
        fleet.worker(fleet.config(api={"api_keys": [KEY_A, KEY_B]}), MODEL)
        unknown = f"never-{uuid.uuid4().hex}"
        for rid in ids:

            def finished(rid: str = rid) -> dict[str, Any] | None:
                doc: dict[str, Any] = http.get(f"/v1/requests/{rid}", headers=a, params={"wait_s": 5}).json()
                return doc if doc["status"] not in ("queued", "running") else None

            done = wait_until(finished, 120, f"request {rid} to finish")
            assert done["status"] == "succeeded", done
            answer = http.get(f"/v1/requests/{rid}", headers=b)
            assert answer.status_code == 404, (rid, answer.status_code, answer.text)  # before: 200, A's result
            assert answer.text.replace(rid, unknown) == http.get(f"/v1/requests/{unknown}", headers=b).text
            assert r.get(OWNER_KEY.format(id=rid)) == owner_a.encode()
    finally:
        r.close()
