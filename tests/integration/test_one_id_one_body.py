"""One request ID names one body on every submit path, and a batch is queued all or none.

Against a real redis-server, with no worker unless said: what the queue holds is then the truth
(each queued task is decoded and its requests counted by ID). The paths: ``FleetClient.submit``,
``submit_many``, ``submit_bulk``, the ``fleet submit`` CLI and ``POST /v1/requests:batch`` (the
gateway app, in process).
"""

from __future__ import annotations

import base64
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from producer.cli import main as fleet_cli
from producer.client import FleetClient
from protocol.errors import IdempotencyConflict
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet
from tools.ledger import Ledger

MODEL = "demo-lm"


def queued(r: redis.Redis[bytes], queue: str) -> list[tuple[str, list[int]]]:
    """(request ID, input ids) of every request in ``queue``'s tasks, ``fleet.infer`` and ``fleet.infer_bulk``."""
    out = []
    for raw in r.lrange(queue, 0, -1):
        envelope = json.loads(raw)
        args = json.loads(base64.b64decode(envelope["body"]))[0]
        task = envelope["headers"]["task"]
        requests = args[0]["requests"] if task == "fleet.infer_bulk" else [args[0]]
        out += [(str(q["request_id"]), list(q["input_ids"])) for q in requests]
    return out


def _batch(http: TestClient, items: list[tuple[str, list[int]]]) -> Any:
    return http.post(
        "/v1/requests:batch",
        json={"requests": [{"model": MODEL, "input_ids": ids, "request_id": rid} for rid, ids in items]},
    )


@pytest.fixture
def served(fleet: Fleet) -> Iterator[tuple[FleetClient, TestClient, redis.Redis[bytes], str]]:
    """A client, the gateway app in process and a Redis connection; no worker (everything stays queued)."""
    cfg = fleet.config()
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    with TestClient(create_app(load_settings(cfg))) as http:
        yield client, http, r, str(cfg)
    r.close()


Served = tuple[FleetClient, TestClient, "redis.Redis[bytes]", str]


def test_a_batch_with_a_conflict_queues_nothing(served: Served) -> None:
    client, http, r, _ = served
    queue = client.settings.queue_for(MODEL)
    refused = _batch(http, [("bb-1", [5, 6, 7]), ("bb-2", [1, 2]), ("bb-1", [9, 9])])
    assert refused.status_code == 409, refused.text
    body = refused.json()
    assert "nothing was queued" in body["message"]
    assert queued(r, queue) == []  # neither bb-1 nor bb-2 can run
    ledger = Ledger(r, [queue])
    for rid in ("bb-1", "bb-2"):
        ledger.refused(rid)
    ledger.check().raise_if_broken()  # no refused_ran, nothing queued
    assert body["type"] == "IdempotencyConflict" and body["field"] == "requests[2].request_id"
    assert http.get("/v1/requests/bb-1").status_code == 404 and http.get("/v1/requests/bb-2").status_code == 404

    # a conflict with an ID already known, after a new one: nothing queued either
    assert client.submit(MODEL, [4, 4], request_id="bb-known") == "bb-known"
    refused = _batch(http, [("bb-3", [1]), ("bb-known", [5])])
    assert refused.status_code == 409 and refused.json()["field"] == "requests[1].request_id"
    assert queued(r, queue) == [("bb-known", [4, 4])]

    # the same body twice in a batch, and a known ID with its own body: one request each, queued once
    accepted = _batch(http, [("bb-1", [5, 6, 7]), ("bb-known", [4, 4]), ("bb-1", [5, 6, 7])])
    assert accepted.status_code == 202, accepted.text
    assert [a["request_id"] for a in accepted.json()["requests"]] == ["bb-1", "bb-known", "bb-1"]
    assert sorted(queued(r, queue)) == [("bb-1", [5, 6, 7]), ("bb-known", [4, 4])]

    # the CLI's submit: the same body is the request, another is refused with a non-zero exit
    assert fleet_cli(["submit", "--config", served[3], "--model", MODEL, "--tokens", "4,4",
                      "--request-id", "bb-known"]) == 0  # fmt: skip
    assert fleet_cli(["submit", "--config", served[3], "--model", MODEL, "--tokens", "4,5",
                      "--request-id", "bb-known"]) != 0  # fmt: skip
    assert len(queued(r, queue)) == 2


def test_racing_submits_of_one_id_on_every_path_queue_one_body(served: Served) -> None:
    """Six threads submit the same fresh ID at once, each on another path and some with another body."""
    client, http, r, _ = served
    queue = client.settings.queue_for(MODEL)
    bodies = ([5, 6, 7], [9, 9])
    paths: list[Callable[[str, list[int]], object]] = [
        lambda rid, ids: client.submit(MODEL, ids, request_id=rid),
        lambda rid, ids: client.submit_bulk(MODEL, [ids], request_id=rid),
        lambda rid, ids: client.submit_many(MODEL, [ids, ids], request_id=rid, progress=False),
        lambda rid, ids: _raise_for(_batch(http, [("other-" + rid, [1]), (rid, ids)])),
    ]
    rounds, threads = 25, 6
    accepted: list[tuple[str, list[int]]] = []
    refused = Counter[str]()
    lock = threading.Lock()
    for n in range(rounds):
        rid = f"race-{n}"
        barrier = threading.Barrier(threads)

        def one(k: int, rid: str = rid, barrier: threading.Barrier = barrier) -> None:
            ids = bodies[k % 2]
            barrier.wait(30)
            try:
                paths[k % len(paths)](rid, ids)
            except IdempotencyConflict:
                with lock:
                    refused[rid] += 1
                return
            with lock:
                accepted.append((rid, ids))

        workers = [threading.Thread(target=one, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
    in_queue = [(rid, ids) for rid, ids in queued(r, queue) if rid.startswith("race-")]
    print(f"racing: {rounds} IDs x {threads} threads: {len(in_queue)} tasks queued, {len(accepted)} calls answered "
          f"with the ID, {sum(refused.values())} refused")
    assert Counter(rid for rid, _ in in_queue) == Counter({f"race-{n}": 1 for n in range(rounds)})
    winner = dict(in_queue)
    assert all(winner[rid] == ids for rid, ids in accepted), "a call was answered for a body that was not queued"
    assert len(accepted) + sum(refused.values()) == rounds * threads
    assert sum(refused.values()) > 0  # the bodies did collide


def _raise_for(resp: Any) -> list[str]:
    """The batch route's answer as the client's: the IDs, or IdempotencyConflict for a 409."""
    if resp.status_code == 409:
        raise IdempotencyConflict(resp.json()["message"], resp.json()["field"], None)
    assert resp.status_code == 202, resp.text
    return [a["request_id"] for a in resp.json()["requests"]]


def _call(client: FleetClient, http: TestClient, path: str, items: list[tuple[str, list[int]]], extra: list[Any]
          ) -> list[str]:  # fmt: skip
    """Submit ``items`` on ``path``; the IDs it answers (IdempotencyConflict when refused)."""
    rid, bodies = items[0][0], [ids for _, ids in items]
    if path == "submit":
        return [client.submit(MODEL, bodies[0], request_id=rid)]
    if path == "many":
        return client.submit_many(MODEL, bodies, request_id=rid, progress=False)
    if path == "bulk":
        return client.submit_bulk(MODEL, bodies, request_id=rid, chunk_size=extra[0])
    return _raise_for(_batch(http, items))


IDS = ["a", "b", "c", "done-0", "done-1"]
BODIES = [[5, 6, 7], [1, 2], [9, 9]]
DONE = {"done-0": [5, 6, 7], "done-1": [1, 2]}
"""IDs with a stored SUCCESS (made by a real worker before the examples) and the bodies they ran."""

item = st.tuples(st.sampled_from(IDS), st.sampled_from(BODIES))
op = st.one_of(
    st.tuples(st.just("submit"), st.lists(item, min_size=1, max_size=1)),
    st.tuples(st.just("many"), st.lists(item, min_size=1, max_size=3)),
    st.tuples(st.just("bulk"), st.lists(item, min_size=1, max_size=3), st.integers(1, 2)),
    st.tuples(st.just("batch"), st.lists(item, min_size=1, max_size=4)),
)


def _expect(items: list[tuple[str, list[int]]], known: dict[str, list[int] | None]) -> bool:
    """Whether a call of ``items`` is accepted: each ID names one body, in the call and against ``known``
    (None: a stored result whose submit marker expired, known whatever its body)."""
    seen: dict[str, list[int]] = {}
    for rid, ids in items:
        if seen.setdefault(rid, ids) != ids:
            return False
    return all(known.get(rid, ids) in (ids, None) for rid, ids in seen.items())


def test_every_path_keeps_one_body_per_id_and_a_stored_success_never_changes(fleet: Fleet) -> None:
    cfg = fleet.config()
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    for rid, ids in DONE.items():
        client.submit(MODEL, ids, request_id=rid)
    assert all(client.wait(list(DONE), 60))
    worker.stop(timeout_s=15)
    r = redis.Redis.from_url(fleet.redis_url)
    result_keys = {rid: client.app.backend.get_key_for_task(rid) for rid in DONE}
    stored = {rid: r.get(key) for rid, key in result_keys.items()}
    markers = {rid: r.get(f"fleet:req:{rid}") for rid in DONE}
    keep = set(result_keys.values())
    queue = client.settings.queue_for(MODEL)
    counts = Counter[str]()

    with TestClient(create_app(load_settings(cfg))) as http:

        @settings(max_examples=50, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
        @given(ops=st.lists(op, min_size=1, max_size=6), done_markers=st.booleans())
        @example(ops=[("bulk", [("done-0", [8, 9, 10, 11, 12, 13, 14])], 1)], done_markers=True)  # the reported bulk
        @example(ops=[("batch", [("a", [5, 6, 7]), ("b", [1, 2]), ("a", [9, 9])])], done_markers=True)  # and batch
        @example(ops=[("many", [("c", [9, 9])]), ("bulk", [("c", [9, 9]), ("c", [9, 9])], 1)], done_markers=False)
        def run(ops: list[tuple[Any, ...]], done_markers: bool) -> None:
            stale = [key for key in r.scan_iter() if key not in keep]  # each example starts from the results alone
            if stale:
                r.delete(*stale)
            known: dict[str, list[int] | None] = {rid: None for rid in DONE}
            if done_markers:  # else the markers expired and the results outlived them
                for rid, marker in markers.items():
                    r.set(f"fleet:req:{rid}", marker or b"")
                known.update(DONE)
            expected_queue: dict[str, list[int]] = {}
            for path, items, *extra in ops:
                if path in ("many", "bulk"):  # one request_id names every input of these calls
                    items = [(items[0][0], ids) for _, ids in items]
                ok = _expect(items, known)
                counts[f"{path} {'accepted' if ok else 'refused'}"] += 1
                try:
                    got = _call(client, http, path, items, extra)
                except IdempotencyConflict:
                    assert not ok, f"{path} {items} refused; known {known}"
                    continue
                assert ok, f"{path} {items} accepted; known {known}"
                assert got == [rid for rid, _ in items]
                for rid, ids in items:
                    if rid not in known:
                        known[rid] = ids
                        expected_queue[rid] = ids
            in_queue = queued(r, queue)
            assert Counter(rid for rid, _ in in_queue) == Counter(list(expected_queue)), (ops, in_queue)
            assert dict(in_queue) == expected_queue
            assert {rid: r.get(key) for rid, key in result_keys.items()} == stored  # never changed
            assert all(r.exists(f"fleet:req:{rid}") == done_markers for rid in DONE)

        run()
    print(f"one ID one body: {sum(counts.values())} calls: {dict(sorted(counts.items()))}")
    assert counts["batch refused"] and counts["bulk refused"] and counts["bulk accepted"]  # the @examples at least
