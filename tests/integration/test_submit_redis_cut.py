"""A Redis failure midway through a batch submit: the caller learns which IDs are queued, which are unknown and
which are not, and the same call again queues each request once.

Real redis-server; the client reaches it through :class:`~tests.integration.redis_cut_proxy.CutProxy`, which
cuts every connection at the Nth claim-and-queue script (:data:`producer.idempotent_queue.CLAIM_AND_QUEUE_LUA`,
one per ``submit_bulk`` chunk, one per ``submit_many`` request), either before Redis runs it (``drop``) or after
(``lose_reply``), and then refuses connections until restored. The queue is read before any worker runs (which
IDs its messages carry), then a real worker serves it and the ledger is checked: every ID reaches one terminal
state, each result written once.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

import pytest
import redis

from protocol.errors import FleetError, SubmitInterrupted
from protocol.keys import REQUEST_KEY
from tests.integration.fleet_fixtures import Fleet
from tests.integration.redis_cut_proxy import CLAIM_AND_QUEUE_SHA, CutProxy
from tools.ledger import Ledger
from tools.processes import poll_until

MODEL = "demo-lm"
QUEUE = "fleet.demo-lm"
INPUTS = [[5, 6, i + 1] for i in range(10)]
CHUNK = 3
"""submit_bulk's chunks: inputs 0-2, 3-5, 6-8, 9; the cut falls at the second (3-5)."""


class _ResultWrites:
    """Every result write, by request ID: the result store script publishes on ``celery-task-meta-<id>`` when,
    and only when, it writes a result."""

    def __init__(self, url: str) -> None:
        self.writes: Counter[str] = Counter()
        self._client = redis.Redis.from_url(url)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe("celery-task-meta-*")
        self._pubsub.get_message(timeout=5)  # the subscription's confirmation
        self._marks: set[str] = set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                msg = self._pubsub.get_message(timeout=1.0)
            except (redis.RedisError, OSError, ValueError):
                return
            if msg is None:
                continue
            meta = json.loads(msg["data"])
            if "mark" in meta:
                self._marks.add(meta["mark"])
            elif meta.get("status") in ("SUCCESS", "FAILURE", "REVOKED"):  # not a generation's STARTED
                self.writes[meta["task_id"]] += 1

    def all_heard(self) -> Counter[str]:
        """The writes heard up to now: a marker published after them is heard after them."""
        self._client.publish("celery-task-meta-mark", json.dumps({"mark": "end"}))
        poll_until(lambda: "end" in self._marks, 30, "the result-write listener to hear its marker")
        return self.writes

    def close(self) -> None:
        self._pubsub.close()
        self._client.close()


def _queued_ids(r: redis.Redis[bytes]) -> list[str]:
    """The request IDs the queue's task messages carry (a ``fleet.infer`` one each, a bulk one its items')."""
    ids: list[str] = []
    for raw in r.lrange(QUEUE, 0, -1):
        envelope = json.loads(raw)
        args = json.loads(base64.b64decode(envelope["body"]))[0]
        payload: dict[str, Any] = args[0]
        if envelope["headers"]["task"] == "fleet.infer_bulk":
            ids += [item["request_id"] for item in payload["requests"]]
        else:
            ids.append(envelope["headers"]["id"])
    return ids


def _submit(call: str, client: Any, **kwargs: Any) -> list[str]:
    if call == "submit_bulk":
        return list(client.submit_bulk(MODEL, INPUTS, chunk_size=CHUNK, **kwargs))
    return list(client.submit_many(MODEL, INPUTS, progress=False, **kwargs))


@pytest.mark.parametrize("mode", ["drop", "lose_reply"])
@pytest.mark.parametrize("call", ["submit_bulk", "submit_many"])
def test_a_redis_cut_midway_says_what_is_queued_and_a_resubmit_queues_each_request_once(
    fleet: Fleet, proxy: CutProxy, call: str, mode: str
) -> None:
    """Before, the plain ``redis.ConnectionError`` propagated: a caller could not tell which chunks were queued
    (and will run), nor whether the one in flight was, nor even the IDs the client had made for its inputs."""
    client = fleet.client(fleet.config(redis_url=proxy.url))
    r = redis.Redis.from_url(fleet.redis_url)
    client.submit(MODEL, [1, 2, 3], request_id="warm-up")  # the script loaded, the task writer set up
    nth = 2 if call == "submit_bulk" else 4  # submit_bulk: chunk 3-5; submit_many: input 3
    proxy.arm("EVALSHA", first_arg=CLAIM_AND_QUEUE_SHA, nth=nth, mode=mode)  # type: ignore[arg-type]

    with pytest.raises(SubmitInterrupted) as info:
        _submit(call, client)
    exc = info.value
    assert proxy.cut.is_set()
    assert isinstance(exc, FleetError) and isinstance(exc.__cause__, redis.ConnectionError)
    ids = exc.request_ids
    assert len(ids) == len(INPUTS) == len(set(ids))
    in_flight = ids[3:6] if call == "submit_bulk" else ids[3:4]
    assert exc.queued_ids == ids[:3]
    assert exc.unknown_ids == in_flight
    assert exc.unqueued_ids == ids[3 + len(in_flight):]
    assert "request_ids=exc.request_ids" in exc.message and "unknown_ids" in exc.message
    assert exc.to_payload()["unknown_ids"] == in_flight

    # what Redis holds says the same: "drop" never ran the step in flight, "lose_reply" ran it
    ran = exc.queued_ids + (in_flight if mode == "lose_reply" else [])
    assert sorted(_queued_ids(r)) == sorted(["warm-up", *ran])
    assert [bool(r.exists(REQUEST_KEY.format(id=rid))) for rid in in_flight] == [mode == "lose_reply"] * len(in_flight)

    proxy.restore()
    assert _submit(call, client, request_ids=ids) == ids  # the same call again, under the same IDs
    assert Counter(_queued_ids(r)) == Counter(["warm-up", *ids])  # every request queued once, whatever the cut

    writes = _ResultWrites(fleet.redis_url)
    try:
        fleet.worker(fleet.config())  # straight to Redis
        ledger = Ledger(r, queues=[QUEUE])
        for rid in ["warm-up", *ids]:
            ledger.accepted(rid)
        report = ledger.check_settled(60)
        assert report.ok, report.as_dict()
        assert report.terminal == {"SUCCESS": len(ids) + 1}, report.as_dict()
        heard = writes.all_heard()
        assert {rid: heard[rid] for rid in ids} == dict.fromkeys(ids, 1)  # each result stored once
    finally:
        writes.close()


def test_a_redis_cut_in_a_single_submit_names_the_id_it_made(fleet: Fleet, proxy: CutProxy) -> None:
    """``submit`` without a caller ID: before, the Redis error carried no ID, so a retry made a new request (run
    twice when the first had been queued); now the error names the ID, and submitting again under it queues
    nothing more."""
    client = fleet.client(fleet.config(redis_url=proxy.url))
    r = redis.Redis.from_url(fleet.redis_url)
    client.submit(MODEL, [1, 2, 3], request_id="warm-up")
    proxy.arm("EVALSHA", first_arg=CLAIM_AND_QUEUE_SHA, nth=1, mode="lose_reply")
    with pytest.raises(SubmitInterrupted) as info:
        client.submit(MODEL, [4, 5, 6])
    exc = info.value
    assert isinstance(exc.__cause__, redis.ConnectionError)
    assert exc.queued_ids == [] and exc.unqueued_ids == [] and len(exc.unknown_ids) == 1
    rid = exc.unknown_ids[0]
    assert f"request_id={rid!r}" in exc.message
    proxy.restore()
    assert client.submit(MODEL, [4, 5, 6], request_id=rid) == rid
    assert Counter(_queued_ids(r)) == Counter(["warm-up", rid])


def test_a_redis_cut_under_threaded_submit_many_stops_every_thread_and_each_id_is_in_one_list(
    fleet: Fleet, proxy: CutProxy
) -> None:
    """Four threads: which requests are in flight at the cut is up to the threads, but each ID is in exactly one
    of the three lists, what Redis holds is the queued ones plus some of the unknown ones, no thread sends after
    the cut (before, the pool went on sending every remaining request, each failing after its retries), and the
    same call again queues each request once."""
    client = fleet.client(fleet.config(redis_url=proxy.url))
    r = redis.Redis.from_url(fleet.redis_url)
    client.submit(MODEL, [1, 2, 3], request_id="warm-up")
    proxy.arm("EVALSHA", first_arg=CLAIM_AND_QUEUE_SHA, nth=4, mode="lose_reply")
    with pytest.raises(SubmitInterrupted) as info:
        client.submit_many(MODEL, INPUTS, progress=False, threads=4)
    exc = info.value
    ids = exc.request_ids
    assert sorted(exc.queued_ids + exc.unknown_ids + exc.unqueued_ids) == sorted(ids)
    assert 1 <= len(exc.unknown_ids) <= 4  # the cut one, and at most one per thread
    held = set(_queued_ids(r)) - {"warm-up"}
    assert set(exc.queued_ids) <= held <= set(exc.queued_ids) | set(exc.unknown_ids)
    proxy.restore()
    assert client.submit_many(MODEL, INPUTS, progress=False, threads=4, request_ids=ids) == ids
    assert Counter(_queued_ids(r)) == Counter(["warm-up", *ids])


def test_a_redis_cut_in_send_batch_names_every_id_as_unknown(fleet: Fleet, proxy: CutProxy) -> None:
    """``send_batch`` (the gateway's batch route and embeddings) queues all or none in one step: a cut there
    leaves all of them unknown, and sending the same requests again queues them once."""
    client = fleet.client(fleet.config(redis_url=proxy.url))
    r = redis.Redis.from_url(fleet.redis_url)
    client.submit(MODEL, [1, 2, 3], request_id="warm-up")
    built = [client.build_request(MODEL, ids) for ids in INPUTS[:4]]
    proxy.arm("EVALSHA", first_arg=CLAIM_AND_QUEUE_SHA, nth=1, mode="drop")
    with pytest.raises(SubmitInterrupted) as info:
        client.send_batch(built)
    exc = info.value
    ids = [str(b.request_id) for b in built]
    assert exc.unknown_ids == ids == exc.request_ids and exc.queued_ids == [] == exc.unqueued_ids
    assert isinstance(exc, redis.ConnectionError)  # what a caller (the gateway: 503) caught before
    assert _queued_ids(r) == ["warm-up"]
    proxy.restore()
    assert client.send_batch(built) == ids
    assert Counter(_queued_ids(r)) == Counter(["warm-up", *ids])


def test_claims_left_by_a_failed_send_task_are_freed_so_the_resubmit_queues_them(
    fleet: Fleet, proxy: CutProxy
) -> None:
    """Where tasks go through Celery's ``send_task`` (a broker with a key prefix: the task writer unusable), a
    chunk's IDs are claimed first, then its message is sent. Redis lost at that send: the claims could not be
    freed (Redis was what failed), so before, a resubmit read those IDs as known and never queued them: lost
    until ``result_ttl_s``. Now the client frees its own left claims before it claims those IDs again."""
    client = fleet.client(fleet.config(redis_url=proxy.url))
    r = redis.Redis.from_url(fleet.redis_url)
    client.writer._usable = False  # the same client, through Celery's send_task
    client.submit(MODEL, [1, 2, 3], request_id="warm-up")
    proxy.arm("LPUSH", first_arg=QUEUE, nth=2, mode="drop")  # chunk 3-5: claimed, its message never sent
    with pytest.raises(SubmitInterrupted) as info:
        client.submit_bulk(MODEL, INPUTS, chunk_size=CHUNK)
    exc = info.value
    ids = exc.request_ids
    assert exc.queued_ids == ids[:3] and exc.unknown_ids == ids[3:6] and exc.unqueued_ids == ids[6:]
    assert sorted(_queued_ids(r)) == sorted(["warm-up", *ids[:3]])
    assert all(r.exists(REQUEST_KEY.format(id=rid)) for rid in ids[3:6])  # claimed, not freed: Redis was down
    proxy.restore()
    assert client.submit_bulk(MODEL, INPUTS, chunk_size=CHUNK, request_ids=ids) == ids
    assert Counter(_queued_ids(r)) == Counter(["warm-up", *ids])


def test_fleet_submit_cut_in_its_queue_step_prints_the_id_to_submit_again(fleet: Fleet, proxy: CutProxy) -> None:
    """``fleet submit`` without ``--request-id``: before, a Redis cut in its queue step printed "cannot reach
    Redis" and no ID, so running it again made a second request when the first had been queued. Now it prints
    the error's JSON with the ID (``unknown_ids``) and a line naming ``--request-id``; running it again with
    that ID queues nothing more."""
    cfg = fleet.config(redis_url=proxy.url)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    client.submit(MODEL, [1, 2, 3], request_id="warm-up")  # the script is loaded in the server
    proxy.arm("EVALSHA", first_arg=CLAIM_AND_QUEUE_SHA, nth=1, mode="lose_reply")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "producer.cli", "submit", "--model", MODEL, "--tokens", "4,5,6",
                               *args, "--config", str(cfg)], capture_output=True, text=True, timeout=120,
                              check=False)  # fmt: skip

    cut = cli()
    assert cut.returncode == 1 and cut.stdout, cut.stderr  # the error's JSON on stdout
    payload = json.loads(cut.stdout)
    assert payload["error"] == "submit_interrupted" and len(payload["unknown_ids"]) == 1, payload
    rid = payload["unknown_ids"][0]
    assert f"--request-id {rid}" in cut.stderr, cut.stderr
    assert Counter(_queued_ids(r)) == Counter(["warm-up", rid])  # it was queued: its reply was what got lost
    proxy.restore()
    again = cli("--request-id", rid)
    assert again.returncode == 0 and json.loads(again.stdout)["request_id"] == rid, again.stderr
    assert Counter(_queued_ids(r)) == Counter(["warm-up", rid])
