"""A worker writes back the bookkeeping of the requests it holds where Redis lost it (a restart without
persistence, a flush): a generation running through the loss reads ``running`` again, not ``not_found``, a
cancel sent after it stops it, and its result is stored once (real worker, real redis-server). Before, such a
request read ``not_found`` (``GET /v1/requests/{id}`` 404, ``cancel`` raised ``RequestNotFound``) until its
result was stored, although the worker was still generating its tokens.

The restore script itself is checked beside stored values it must leave alone: a terminal result is never
turned back into STARTED."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.client import FleetClient, RequestStatus
from protocol.keys import REQUEST_KEY, RESULT_KEY, TAKEN_KEY, WORKER_KEY_PREFIX
from protocol.messages import InferenceRequest, InferenceResult, OutputSpec
from protocol.request_marker import request_marker
from tests.integration.fleet_fixtures import Fleet
from tools.build_lm import build_causal_lm
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis
from workers.held_requests import HeldRequests, started_meta

MAX_TOKENS = 3000
"""Tokens the generation asks for (ignore_eos): many seconds of decoding on the slow LM, so it runs through
the loss and past the next heartbeat (0.5 s) on any machine; the cancel ends it early."""
GENERATE = OutputSpec(kind="generate", generation={"max_new_tokens": 8, "ignore_eos": True})


@pytest.fixture(scope="module")
def slow_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wider, deeper demo LM with room for :data:`MAX_TOKENS` (same byte tokenizer)."""
    return build_causal_lm(tmp_path_factory.mktemp("slow-lm"), hidden_size=256, num_layers=6, num_heads=4,
                           max_positions=MAX_TOKENS + 64)  # fmt: skip


def _status(client: FleetClient, rid: str) -> RequestStatus | None:
    """The request's status; None while Redis does not answer (it restarts)."""
    try:
        return client.status(rid)
    except redis.RedisError:
        return None


def _beats(r: redis.Redis[bytes], hostname: str) -> float:
    """The worker's last heartbeat time (0 when none is published)."""
    raw = r.get(WORKER_KEY_PREFIX + hostname)
    return float(json.loads(raw)["heartbeat_unix_s"]) if raw else 0.0


@pytest.mark.parametrize("loss", ["flushall", "restart"])
def test_a_generation_running_through_a_redis_data_loss_reads_running_and_cancels(
    fleet: Fleet, redis_server: EmbeddedRedis, slow_lm: Path, loss: str
) -> None:
    cfg = fleet.config(models={"demo-lm": {"path": str(slow_lm), "batching": {"max_batch_size": 1},
                                           "limits": {"max_new_tokens": MAX_TOKENS}}})  # fmt: skip
    worker = fleet.worker(cfg, concurrency=2)
    client = fleet.client(cfg)
    r = redis.Redis(port=redis_server.port)
    rid = client.submit("demo-lm", [20, 21], generation={"max_new_tokens": MAX_TOKENS, "ignore_eos": True})
    for event in client.stream(rid, timeout_s=60):
        if event.index >= 1:
            break
    assert client.status(rid) is RequestStatus.RUNNING
    marker = r.get(REQUEST_KEY.format(id=rid))
    assert marker is not None

    if loss == "flushall":
        r.flushall()
    else:
        redis_server.kill()
        redis_server.start()  # same port, empty: nothing was persisted

    seen: list[RequestStatus | None] = []  # each status read in turn, repeats folded

    def known() -> RequestStatus | None:
        status = _status(client, rid)
        if not seen or seen[-1] != status:
            seen.append(status)
        return status if status not in (None, RequestStatus.NOT_FOUND) else None

    assert poll_until(known, 60, "the generation to be known again") is RequestStatus.RUNNING, (
        f"statuses read after the loss: {seen}")  # fmt: skip
    assert r.get(REQUEST_KEY.format(id=rid)) == marker  # the producer's marker, byte for byte
    channel = r.pubsub()
    channel.subscribe(RESULT_KEY.format(id=rid))  # every result stored is published here
    poll_until(lambda: channel.get_message(timeout=0.1), 30, "the subscription to the result's channel")
    try:
        assert client.cancel(rid, settle_s=60)  # a mark set after the loss stops the generation
        result = client.result(rid, wait=True, timeout_s=60)
        assert isinstance(result, InferenceResult) and result.generation is not None
        assert result.generation.finish_reason == "cancelled"
        assert 2 <= len(result.generation.token_ids) < MAX_TOKENS
        stored = r.get(RESULT_KEY.format(id=rid))
        beat = _beats(r, worker.hostname)
        poll_until(lambda: _beats(r, worker.hostname) > beat, 30, "a heartbeat after the result was stored")
        beat = _beats(r, worker.hostname)
        poll_until(lambda: _beats(r, worker.hostname) > beat, 30, "a second heartbeat after it")
        assert r.get(RESULT_KEY.format(id=rid)) == stored  # a released request is not written back
        outcomes = []  # published two heartbeats ago or more: in the socket's buffer by now
        while (message := channel.get_message(timeout=0.1)) is not None:
            outcomes.append(json.loads(message["data"])["status"])
    finally:
        channel.close()
    assert outcomes == ["SUCCESS"]  # stored once
    assert client.status(rid) is RequestStatus.SUCCEEDED
    assert "Redis lacked the marker or STARTED state of 1 of the 1 requests" in worker.log_tail(200_000)


def _calls(r: redis.Redis[bytes], command: str) -> int:
    """How many times Redis ran ``command`` (scripts' commands included)."""
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def _request(rid: str) -> InferenceRequest:
    return InferenceRequest(model="demo-lm", input_ids=[5, 6], request_id=rid, output=GENERATE,
                            submitted_at_unix_s=1733000000.5)  # fmt: skip


def test_the_restore_writes_only_what_is_missing_and_never_touches_a_stored_outcome(
    redis_server: EmbeddedRedis,
) -> None:
    r = redis.Redis(port=redis_server.port)
    held = HeldRequests(r, ttl_s=600)
    rids = ["lost", "marker-kept", "succeeded", "failed", "revoked", "one-step"]
    for rid in rids:
        held.hold(rid, _request(rid), started_by=None if rid == "one-step" else "w1@test")
    r.set(REQUEST_KEY.format(id="marker-kept"), "another marker")
    outcomes: dict[str, Any] = {}
    for rid, state in (("succeeded", "SUCCESS"), ("failed", "FAILURE"), ("revoked", "REVOKED")):
        outcomes[rid] = json.dumps({"status": state, "result": None, "task_id": rid}).encode()
        r.set(RESULT_KEY.format(id=rid), outcomes[rid], ex=50)

    held.restore()
    assert held.restored == len(rids)  # each had something missing
    for rid in rids:
        kept = b"another marker" if rid == "marker-kept" else request_marker(_request(rid)).encode()
        assert r.get(REQUEST_KEY.format(id=rid)) == kept
    assert r.get(RESULT_KEY.format(id="lost")) == started_meta("lost", pid=os.getpid(), hostname="w1@test").encode()
    for rid, stored in outcomes.items():
        assert r.get(RESULT_KEY.format(id=rid)) == stored  # an outcome is never turned back into STARTED
        assert r.ttl(RESULT_KEY.format(id=rid)) <= 50  # nor its life extended
    assert not r.exists(RESULT_KEY.format(id="one-step"))  # no STARTED was stored for it: none is written
    assert 590 < r.ttl(REQUEST_KEY.format(id="lost")) <= 600 and 590 < r.ttl(RESULT_KEY.format(id="lost")) <= 600
    # every held request's taken note too: a cancel after the loss is asked of this worker, not for good
    assert all(590 < r.ttl(TAKEN_KEY.format(id=rid)) <= 600 for rid in rids)

    sets = _calls(r, "set")
    held.restore()  # nothing missing now: nothing written, not even a SET that finds its key
    assert held.restored == len(rids) and _calls(r, "set") == sets
    held.release("lost")
    r.delete(REQUEST_KEY.format(id="lost"), RESULT_KEY.format(id="lost"))
    held.restore()
    assert not r.exists(REQUEST_KEY.format(id="lost"), RESULT_KEY.format(id="lost"))  # released: not held
