"""A request submitted through the gateway belongs to the API key that submitted it: two keys against a real
gateway process, a real demo-lm worker and real Redis (httpx, as the native API's clients call it).

Reported: ``/v1/requests`` was unscoped. Any accepted key could read (``GET``, long-poll), stream or cancel any
request whose ID it knew, and a resubmit of another key's ``request_id`` with the same body answered that
request's status. Now another key gets the 404 of an unknown ID on every per-ID route (the same body), its
cancel touches nothing, a resubmit of the ID is a 409 whatever the body, and a request with no owner mark
(``FleetClient`` straight to Redis) stays every key's. The mark lives as long as the result
(:mod:`gateway.request_owners`, :mod:`broker.result_backend`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from celery import states

from broker import make_celery, result_backend
from gateway.auth import owner_of
from producer.client import FleetClient
from protocol.celeryconf import celery_config
from protocol.keys import CANCEL_KEY, OWNER_KEY, REQUEST_KEY, RESPONSE_KEY
from protocol.settings import load_settings
from tests.integration.openai_fixtures import ops_models, ops_redis
from tests.integration.ops_fixtures import OpsFleet
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

pytestmark = pytest.mark.timeout(300)

KEY_A = "owners-key-a"
KEY_B = "owners-key-b"
IDLE = "idle-lm"
"""The demo LM under another name that no worker serves: its requests stay queued."""
GENERATE: dict[str, Any] = {"model": "demo-lm", "input_ids": [5, 6, 7],
                            "output": {"kind": "generate", "generation": {"max_new_tokens": 8}}}  # fmt: skip


CONFIGS: dict[str, Path] = {}
"""The module fleet's config file, under "fleet"."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis) -> Iterator[OpsFleet]:
    """Gateway 0 with two keys, one demo-lm worker; ``idle-lm`` has none. Gateway 1: the same keys, every submit
    sent alone (``api.group_submits`` false), and ``demo-encoder`` configured with no worker (given up on at
    once)."""
    fleet = OpsFleet(tmp_path_factory.mktemp("owners"), ops_models, ops_redis)
    try:
        limits = {"limits": {"max_input_tokens": 64}}
        config = fleet.config(serve=("demo-lm",), models={IDLE: {"path": str(ops_models.lm), **limits}},
                              api={"api_keys": [KEY_A, KEY_B]})  # fmt: skip
        fleet.worker(config, "demo-lm")
        fleet.gateway(config)
        CONFIGS["fleet"] = config
        alone_api = {"api_keys": [KEY_A, KEY_B], "group_submits": False, "no_worker_wait_s": 0.5}
        alone = fleet.config(serve=("demo-lm", "demo-encoder"), models={IDLE: {"path": str(ops_models.lm), **limits}},
                             api=alone_api)  # fmt: skip
        fleet.gateway(alone)
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def clients(fleet: OpsFleet) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """Client a (key a) and client b (key b), on the same gateway."""
    url = fleet.gateways[0].url
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY_A}, timeout=60) as a, \
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60) as b:  # fmt: skip
        yield a, b


def _finished(http: httpx.Client, rid: str) -> dict[str, Any]:
    """``GET /v1/requests/{rid}?wait_s=`` until the request has finished (the gateway's long-poll, no sleeps)."""
    for _ in range(10):
        doc: dict[str, Any] = http.get(f"/v1/requests/{rid}", params={"wait_s": 10}).json()
        if doc.get("status") not in ("queued", "running"):
            return doc
    raise AssertionError(f"request {rid} did not finish: {doc}")


def _refused(answer: httpx.Response, rid: str, unknown: str, unknown_answer: httpx.Response) -> None:
    """``answer`` (for ``rid``) is a 404 whose body, ``rid`` written as ``unknown``, is ``unknown_answer``'s."""
    assert answer.status_code == 404, (answer.status_code, answer.text)
    assert unknown_answer.status_code == 404, unknown_answer.text
    assert answer.text.replace(rid, unknown) == unknown_answer.text, (answer.text, unknown_answer.text)


def test_another_key_is_told_a_request_does_not_exist_on_every_route(
    fleet: OpsFleet, clients: tuple[httpx.Client, httpx.Client]
) -> None:
    a, b = clients
    rid = a.post("/v1/requests", json=GENERATE).json()["request_id"]
    done = _finished(a, rid)
    assert done["status"] == "succeeded", done
    unknown = uuid.uuid4().hex

    for method, path, params in (("GET", "/v1/requests/{}", {}), ("GET", "/v1/requests/{}", {"wait_s": 1}),
                                 ("GET", "/v1/requests/{}/stream", {}), ("DELETE", "/v1/requests/{}", {})):  # fmt: skip
        answer = b.request(method, path.format(rid), params=params)
        _refused(answer, rid, unknown, b.request(method, path.format(unknown), params=params))

    # a still reads and streams its request; b's DELETE changed nothing
    assert a.get(f"/v1/requests/{rid}").json() == done
    with a.stream("GET", f"/v1/requests/{rid}/stream") as events:
        assert events.status_code == 200 and '"final"' in events.read().decode()
    stored = fleet.redis.get(OWNER_KEY.format(id=rid))
    assert stored is not None and stored.decode() == owner_of(KEY_A, [KEY_A.encode(), KEY_B.encode()])
    assert KEY_A.encode() not in stored  # a keyed digest, never the key


def test_another_keys_cancel_leaves_the_request_running(
    fleet: OpsFleet, clients: tuple[httpx.Client, httpx.Client]
) -> None:
    """b's DELETE of a's generation, sent while it is queued or running, is a 404 and writes no cancel mark: the
    generation runs to its end (not cancelled) and succeeds for a; a queued request of a model nobody serves stays
    queued, until a cancels it."""
    a, b = clients
    body = {**GENERATE, "output": {"kind": "generate", "generation": {"max_new_tokens": 32}}}
    rid = a.post("/v1/requests", json=body).json()["request_id"]
    assert b.delete(f"/v1/requests/{rid}").status_code == 404
    assert not fleet.redis.exists(CANCEL_KEY.format(id=rid))
    done = _finished(a, rid)
    assert done["status"] == "succeeded" and done["result"]["generation"]["finish_reason"] != "cancelled", done

    queued = a.post("/v1/requests", json={**body, "model": IDLE}).json()["request_id"]
    assert b.delete(f"/v1/requests/{queued}").status_code == 404
    assert a.get(f"/v1/requests/{queued}").json()["status"] == "queued"
    assert a.delete(f"/v1/requests/{queued}").json()["status"] == "cancelled"  # its owner cancels it
    owner_ttl, mark_ttl = fleet.redis.ttl(OWNER_KEY.format(id=queued)), fleet.redis.ttl(CANCEL_KEY.format(id=queued))
    assert owner_ttl >= mark_ttl - 1 > 0, (owner_ttl, mark_ttl)  # "cancelled" is a's as long as the cancel mark lives


def test_a_request_without_an_owner_mark_is_every_keys(
    fleet: OpsFleet, clients: tuple[httpx.Client, httpx.Client]
) -> None:
    """Submitted by ``FleetClient`` straight to Redis (no gateway, no key): both keys read it, and a resubmit of
    its ID through the gateway does not make it the resubmitting key's."""
    a, b = clients
    client = FleetClient(load_settings(CONFIGS["fleet"]))  # no gateway, no key: no owner mark
    try:
        rid = client.submit("demo-lm", [5, 6, 7], request_id=f"plain-{uuid.uuid4().hex}")
    finally:
        client.close()
    done = _finished(a, rid)
    assert done["status"] == "succeeded" and b.get(f"/v1/requests/{rid}").json() == done
    again = b.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5, 6, 7], "request_id": rid})
    assert again.status_code == 202 and again.json()["status"] == "succeeded", again.text
    assert not fleet.redis.exists(OWNER_KEY.format(id=rid))
    assert a.get(f"/v1/requests/{rid}").json() == done


def test_another_keys_request_id_is_refused_alike_whatever_the_body(
    fleet: OpsFleet, clients: tuple[httpx.Client, httpx.Client]
) -> None:
    """b resubmitting a's ``request_id``: the same 409 with a's body or another, nothing queued, a's request
    untouched; in a batch, nothing of the batch is queued. a's own resubmit still answers its status."""
    a, b = clients
    rid = f"a-{uuid.uuid4().hex}"
    body = {"model": "demo-lm", "input_ids": [5, 6, 7], "request_id": rid}
    assert a.post("/v1/requests", json=body).status_code == 202
    done = _finished(a, rid)
    same = b.post("/v1/requests", json=body)
    other = b.post("/v1/requests", json={**body, "input_ids": [8, 9]})
    assert same.status_code == other.status_code == 409, (same.text, other.text)
    assert same.json() == other.json() and same.json()["field"] == "request_id", same.json()
    assert rid in same.json()["message"] and "different body" not in same.json()["message"]
    assert a.post("/v1/requests", json=body).json()["status"] == "succeeded"  # the owner's idempotent resubmit

    fresh = f"b-{uuid.uuid4().hex}"
    batch = b.post("/v1/requests:batch", json={"requests": [{**body, "request_id": fresh}, body]})
    assert batch.status_code == 409 and batch.json()["field"] == "requests[1].request_id", batch.text
    assert not fleet.redis.exists(REQUEST_KEY.format(id=fresh)) and not fleet.redis.exists(OWNER_KEY.format(id=fresh))
    assert a.get(f"/v1/requests/{rid}").json() == done


def test_grouped_and_openai_submits_belong_to_their_key(
    fleet: OpsFleet, clients: tuple[httpx.Client, httpx.Client]
) -> None:
    """Requests queued through the submit groups (no ``request_id``; ``/v1/completions``, whose
    ``X-Request-ID`` names its request under ``/v1/requests``), a batch's, and a ``/v1/responses`` turn's (sent
    alone: ``resp_<id>`` names it) are owned too."""
    a, b = clients
    grouped = a.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5, 6]}).json()["request_id"]
    completion = a.post("/v1/completions", json={"model": "demo-lm", "prompt": "Hi", "max_tokens": 2})
    assert completion.status_code == 200, completion.text
    batch = a.post("/v1/requests:batch", json={"requests": [{"model": "demo-lm", "input_ids": [5]}]})
    turn = a.post("/v1/responses", json={"model": "demo-lm", "input": "Hi", "max_output_tokens": 2, "store": False})
    assert turn.status_code == 200, turn.text
    for rid in (grouped, completion.headers["X-Request-ID"], batch.json()["requests"][0]["request_id"],
                turn.headers["X-Request-ID"]):  # fmt: skip
        assert _finished(a, rid)["status"] == "succeeded"
        assert b.get(f"/v1/requests/{rid}").status_code == 404, rid


def test_submits_sent_alone_belong_to_their_key(fleet: OpsFleet) -> None:
    """With ``api.group_submits`` false each route queues its requests alone (``FleetClient.send`` /
    ``send_batch``): ``/v1/requests``, ``/v1/completions`` and ``/v1/embeddings`` (whose ``X-Request-ID`` lists
    its requests; no encoder worker, so the gateway gives up on them, and they stay a's)."""
    url = fleet.gateways[1].url
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY_A}, timeout=60) as a, \
            httpx.Client(base_url=url, headers={"X-API-Key": KEY_B}, timeout=60) as b:  # fmt: skip
        native = a.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5, 6]}).json()["request_id"]
        completion = a.post("/v1/completions", json={"model": "demo-lm", "prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 200, completion.text
        vectors = a.post("/v1/embeddings", json={"model": "demo-encoder", "input": ["a", "b"]})
        assert vectors.status_code >= 400 and vectors.headers["X-Request-ID"], vectors.text
        ids = [native, completion.headers["X-Request-ID"], *vectors.headers["X-Request-ID"].split(",")]
        assert len(ids) == 4
        for rid in ids:
            assert a.get(f"/v1/requests/{rid}").status_code == 200, rid
            assert b.get(f"/v1/requests/{rid}").status_code == 404, rid


def test_the_owner_mark_is_given_the_results_time_to_live(fleet: OpsFleet) -> None:
    """The worker's store script gives the mark the result's TTL, as it gives the submit marker: a mark set at
    submit would otherwise expire a queue wait and a run before the result, which any key could then read."""
    app = make_celery(celery_config(load_settings(redis_url=fleet.redis_url)), "owner-ttl-test")
    result_backend.install(app)
    app.conf.update(result_expires=600)
    rid = f"ttl-{uuid.uuid4().hex}"
    fleet.redis.set(OWNER_KEY.format(id=rid), "someone", ex=5)  # as if submitted long ago
    app.backend.store_result(rid, {"n": 1}, states.SUCCESS)
    assert fleet.redis.ttl(OWNER_KEY.format(id=rid)) > 5
    assert abs(fleet.redis.ttl(OWNER_KEY.format(id=rid)) - fleet.redis.ttl(f"celery-task-meta-{rid}")) <= 1


def test_another_keys_response_is_refused_before_it_is_parsed(
    fleet: OpsFleet, clients: tuple[httpx.Client, httpx.Client]
) -> None:
    """The Responses store compares the owner, written first, before it parses the document: b is told the
    404 of an unknown ID even for a document it could not parse (before: parsed first, a 500)."""
    a, b = clients
    made = a.post("/v1/responses", json={"model": "demo-lm", "input": "Hi", "max_output_tokens": 2, "temperature": 0})
    assert made.status_code == 200, made.text
    raw = fleet.redis.get(RESPONSE_KEY.format(id=made.json()["id"]))
    assert raw is not None and raw.startswith(b'{"owner":"'), raw
    owner = owner_of(KEY_A, [KEY_A.encode(), KEY_B.encode()])
    broken = f"resp_{uuid.uuid4().hex}"
    fleet.redis.set(RESPONSE_KEY.format(id=broken), f'{{"owner":"{owner}","response":{{'.encode(), ex=60)
    unknown = f"resp_{uuid.uuid4().hex}"
    _refused(b.get(f"/v1/responses/{broken}"), broken, unknown, b.get(f"/v1/responses/{unknown}"))


def test_an_unclaimed_redis_keeps_no_marks_with_auth_off(ops_redis: EmbeddedRedis) -> None:
    """With no key configured the gateway writes and reads no mark (nothing changes with auth off)."""
    from gateway.auth import OPEN_OWNER
    from gateway.request_owners import RequestOwners

    r = redis.Redis.from_url(ops_redis.url)
    owners = RequestOwners(r, [], 600)
    owner = owners.owner_for("anonymous")
    assert owner == OPEN_OWNER
    rid = f"open-{uuid.uuid4().hex}"
    assert owners.claim([rid], [owner]) == [] and not r.exists(OWNER_KEY.format(id=rid))
    r.set(OWNER_KEY.format(id=rid), "someone")
    assert owners.readable(rid, owner)
