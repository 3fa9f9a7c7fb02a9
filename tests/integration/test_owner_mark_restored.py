"""An owner mark Redis lost while its request waited is written back by the worker that stores the result: real
gateway, real Redis, a real demo-lm worker started after the loss (:mod:`broker.result_backend`).

Reported: after Redis lost data (a restart without persistence, a flush, an eviction), the worker wrote the
request's submit marker back but not its owner mark (``fleet:owner:<id>``), so the request, once its result was
stored, read as one submitted straight to Redis: any API key read it. Now the gateway's task message carries the
owner (``fleet_owners`` header) and the worker's result store writes a missing mark back with the result, in the
same step; a message without the header (a plain Celery client's) still stores no mark.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery

from gateway.auth import owner_of
from producer.client import FleetClient
from producer.task_writer import owners_in_messages
from protocol.keys import OWNER_KEY
from protocol.settings import load_settings
from tests.integration.ops_fixtures import OpsFleet, ops_models, ops_redis, wait_until
from tools.build_lm import build_causal_lm
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

pytestmark = pytest.mark.timeout(300)

SLOW = "slow-lm"
"""A wider, deeper demo LM (same byte tokenizer): a generation of :data:`MAX_TOKENS` runs for seconds."""
MAX_TOKENS = 3000
LATE = "late-lm"
"""The demo LM under another name, its worker started by the one test that needs it."""
KEY_A = "restored-key-a"
KEY_B = "restored-key-b"
BODY: dict[str, Any] = {"model": "demo-lm", "input_ids": [5, 6, 7]}


class Lost:
    """The module's fleet: a gateway with two keys, no worker until :meth:`start_worker`."""

    def __init__(self, fleet: OpsFleet, config: Path) -> None:
        self.fleet = fleet
        self.config = config
        self.owner_a = owner_of(KEY_A, [KEY_A.encode(), KEY_B.encode()])
        url = fleet.gateways[0].url
        self.a = httpx.Client(base_url=url, headers={"X-API-Key": KEY_A}, timeout=60)
        self.b = httpx.Client(base_url=url, headers={"X-API-Key": KEY_B}, timeout=60)
        self._worker_started = False

    def start_worker(self) -> None:
        if not self._worker_started:
            self.fleet.worker(self.config, "demo-lm")
            self._worker_started = True

    def finished(self, rid: str) -> dict[str, Any]:
        """A's view of ``rid`` once it has finished (the gateway's long-poll)."""

        def done() -> dict[str, Any] | None:
            doc: dict[str, Any] = self.a.get(f"/v1/requests/{rid}", params={"wait_s": 5}).json()
            return doc if doc.get("status") not in ("queued", "running") else None

        view: dict[str, Any] = wait_until(done, 60, f"request {rid} to finish")
        return view

    def lose_marks(self, ids: list[str]) -> None:
        """Delete the owner marks of ``ids``, as a Redis restart without persistence would (the queued messages
        survive here, as they would in an append-only file rewritten before the marks were)."""
        assert all(self.fleet.redis.get(OWNER_KEY.format(id=rid)) == self.owner_a.encode() for rid in ids)
        self.fleet.redis.delete(*(OWNER_KEY.format(id=rid) for rid in ids))

    def assert_a_alone_reads(self, rid: str) -> None:
        done = self.finished(rid)
        assert done["status"] == "succeeded", done
        unknown = f"never-{uuid.uuid4().hex}"
        answer, unknown_answer = self.b.get(f"/v1/requests/{rid}"), self.b.get(f"/v1/requests/{unknown}")
        assert answer.status_code == 404, (rid, answer.status_code, answer.text)  # before: 200, a's result
        assert answer.text.replace(rid, unknown) == unknown_answer.text
        assert self.fleet.redis.get(OWNER_KEY.format(id=rid)) == self.owner_a.encode()
        mark_ttl = self.fleet.redis.ttl(OWNER_KEY.format(id=rid))
        assert abs(mark_ttl - self.fleet.redis.ttl(f"celery-task-meta-{rid}")) <= 1, mark_ttl  # the result's TTL


@pytest.fixture(scope="module")
def lost(tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis) -> Iterator[Lost]:
    """The gateway (keys a and b; ``demo-lm`` and :data:`SLOW`), no worker yet."""
    root = tmp_path_factory.mktemp("owner-restored")
    fleet = OpsFleet(root, ops_models, ops_redis)
    try:
        slow = build_causal_lm(root / "slow", hidden_size=256, num_layers=6, num_heads=4,
                               max_positions=MAX_TOKENS + 64)  # fmt: skip
        models = {SLOW: {"path": str(slow), "batching": {"max_batch_size": 1},
                         "limits": {"max_input_tokens": 64, "max_new_tokens": MAX_TOKENS}},
                  LATE: {"path": str(ops_models.lm), "limits": {"max_input_tokens": 64}}}  # fmt: skip
        config = fleet.config(serve=("demo-lm",), models=models, api={"api_keys": [KEY_A, KEY_B]})
        fleet.gateway(config)
        state = Lost(fleet, config)
        try:
            yield state
        finally:
            state.a.close()
            state.b.close()
    finally:
        fleet.close()


def test_a_mark_lost_while_queued_is_written_back_with_the_result(lost: Lost) -> None:
    """A's requests, queued alone (a caller-given ID), in a batch and through the submit groups (concurrent
    submits without an ID: grouped into ``fleet.infer_bulk`` messages where they arrive together), lose their marks
    while no worker runs; the worker started next stores each result with A's mark again, and B is told each one
    does not exist."""
    alone = lost.a.post("/v1/requests", json={**BODY, "request_id": f"alone-{uuid.uuid4().hex}"})
    batch = lost.a.post("/v1/requests:batch", json={"requests": [BODY, {**BODY, "input_ids": [8, 9]}]})
    assert alone.status_code == 202 and batch.status_code == 202, (alone.text, batch.text)
    grouped: list[str] = []
    lock = threading.Lock()

    def submit_grouped(n: int) -> None:
        answer = lost.a.post("/v1/requests", json={**BODY, "input_ids": [5, 6 + n]})
        assert answer.status_code == 202, answer.text
        with lock:
            grouped.append(answer.json()["request_id"])

    threads = [threading.Thread(target=submit_grouped, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ids = [alone.json()["request_id"], *(r["request_id"] for r in batch.json()["requests"]), *grouped]
    assert len(ids) == 11
    lost.lose_marks(ids)
    lost.start_worker()
    for rid in ids:
        lost.assert_a_alone_reads(rid)


def test_a_bulk_message_carries_its_requests_owners(lost: Lost) -> None:
    """``FleetClient.submit_bulk`` inside :func:`producer.task_writer.owners_in_messages`: one ``fleet.infer_bulk``
    message whose header names A for two of its three requests; their marks, lost before it runs, come back with
    their results, and the third stays every key's."""
    lost.start_worker()
    client = FleetClient(load_settings(lost.config))
    ids = [f"bulk-{n}-{uuid.uuid4().hex}" for n in range(3)]
    try:
        with owners_in_messages({ids[0]: lost.owner_a, ids[1]: lost.owner_a}):
            client.submit_bulk("demo-lm", [[5, 6], [7, 8], [9]], request_ids=ids)
        client.wait(ids, 60)
    finally:
        client.close()
    for rid in ids[:2]:
        lost.assert_a_alone_reads(rid)
    assert not lost.fleet.redis.exists(OWNER_KEY.format(id=ids[2]))
    assert lost.b.get(f"/v1/requests/{ids[2]}").status_code == 200


def test_a_plain_celery_message_still_stores_no_mark(lost: Lost) -> None:
    """No header, no owner: a plain Celery client's request is stored as before, every key's."""
    lost.start_worker()
    plain = Celery(broker=lost.fleet.redis_url, backend=lost.fleet.redis_url)
    rid = f"plain-{uuid.uuid4().hex}"
    try:
        plain.send_task("fleet.infer", args=[BODY], task_id=rid, queue="fleet.demo-lm").get(timeout=60)
    finally:
        plain.close()
    assert not lost.fleet.redis.exists(OWNER_KEY.format(id=rid))
    assert lost.b.get(f"/v1/requests/{rid}").json()["status"] == "succeeded"


def test_a_mark_lost_while_running_is_written_back_with_the_marker(lost: Lost) -> None:
    """A's generation runs through a ``FLUSHALL``: the worker writes its marker and STARTED state back at its next
    heartbeat, and its owner mark with them (the mark first), so B is told it does not exist and B's cancel
    touches nothing (before: B read it ``running`` and could cancel it); A cancels it, and only A reads the result."""
    lost.fleet.worker(lost.config, SLOW)
    body = {"model": SLOW, "input_ids": [20, 21],
            "output": {"kind": "generate", "generation": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}}}
    rid = lost.a.post("/v1/requests", json=body).json()["request_id"]

    def reads(status: str) -> bool:
        answer = lost.a.get(f"/v1/requests/{rid}")
        return answer.status_code == 200 and answer.json()["status"] == status

    wait_until(lambda: reads("running"), 60, "A's generation to run")
    lost.fleet.redis.flushall()
    wait_until(lambda: reads("running"), 60, "A's generation to read running again (its worker's heartbeat)")
    unknown = f"never-{uuid.uuid4().hex}"
    for method, path in (("GET", "/v1/requests/{}"), ("DELETE", "/v1/requests/{}"), ("GET", "/v1/requests/{}/stream")):
        answer = lost.b.request(method, path.format(rid))
        assert answer.status_code == 404, (method, path, answer.status_code, answer.text)  # before: 200, running
        assert answer.text.replace(rid, unknown) == lost.b.request(method, path.format(unknown)).text
    assert lost.fleet.redis.get(OWNER_KEY.format(id=rid)) == lost.owner_a.encode()
    cancelled = lost.a.delete(f"/v1/requests/{rid}")
    assert cancelled.status_code == 200, cancelled.text
    done = lost.finished(rid)
    assert done["status"] == "succeeded" and done["result"]["generation"]["finish_reason"] == "cancelled", done
    assert lost.b.get(f"/v1/requests/{rid}").status_code == 404


def test_a_long_poll_that_began_before_the_mark_came_back_is_refused_its_result(lost: Lost) -> None:
    """B long-polls A's request while its mark is lost (it reads as every key's then); the worker stores the result
    and writes the mark back in one step, and the gateway looks at the mark again once the wait ends: B gets the
    404 of an unknown ID, not A's result. The same second look closes the race of a read that checks an ID before
    another key's submit of it and reads it after (the mark is written before the request is known)."""
    rid = f"late-{uuid.uuid4().hex}"
    assert lost.a.post("/v1/requests", json={"model": LATE, "input_ids": [5, 6], "request_id": rid}).status_code == 202
    lost.lose_marks([rid])
    answers: list[httpx.Response] = []
    polling = threading.Thread(target=lambda: answers.append(lost.b.get(f"/v1/requests/{rid}",
                                                                          params={"wait_s": 60})))  # fmt: skip
    polling.start()
    channel = f"celery-task-meta-{rid}"
    wait_until(lambda: any(count for _, count in lost.fleet.redis.pubsub_numsub(channel)), 30,
               "B's long-poll to wait on the result's channel")  # fmt: skip
    lost.fleet.worker(lost.config, LATE)
    polling.join(90)
    assert answers and answers[0].status_code == 404, [(a.status_code, a.text) for a in answers]  # before: 200
    lost.assert_a_alone_reads(rid)
