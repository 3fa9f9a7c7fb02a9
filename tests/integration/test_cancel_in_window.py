"""A one-step request cancelled while it waits in a worker's batch window ends cancelled, unrun, and the
request beside it in the same window runs (real redis-server, real worker, real ONNX Runtime).

Before, the worker read the cancel mark only as it took the message: ``cancel`` answered True (a one-step
request the worker holds reads ``queued``), the client read it as cancelled from the mark alone, and then the
request ran with the others of its window and its SUCCESS was stored, which the client read from then on.
"""

from __future__ import annotations

import json
import threading

import pytest
import redis
from celery import states

from protocol.errors import RequestCancelled
from protocol.keys import CANCEL_CHANNEL, RESULT_KEY, WORKER_KEY_PREFIX
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tools.processes import poll_until

# The window stays open 10 s (the longest allowed) and closes only then: 2 requests never fill 8 rows, and
# close_when_idle off keeps a worker with nothing on its way from running them at once.
HOLDING = {"models": {"demo-lm": {"batching": {"max_batch_size": 8, "max_wait_ms": 10_000,
                                               "close_when_idle": False}}}}  # fmt: skip


def _in_flight(r: redis.Redis[bytes], hostname: str) -> int:
    """The requests ``hostname`` holds, from its heartbeat (-1 before its first)."""
    raw = r.get(WORKER_KEY_PREFIX + hostname)
    return int(json.loads(raw)["in_flight"]) if raw else -1


@pytest.mark.parametrize(("bulk", "track_started"), [(False, False), (True, False), (False, True)],
                         ids=["infer", "infer_bulk", "infer_track_started"])
def test_a_request_cancelled_in_the_batch_window_ends_cancelled_and_its_sibling_runs(
        fleet: Fleet, bulk: bool, track_started: bool) -> None:
    # with celery.track_started on, a held one-step request reads running; before, cancel then said False
    cfg = fleet.config(**HOLDING, celery={"track_started": track_started})
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    if bulk:
        doomed, sibling = client.submit_bulk("demo-lm", [[5, 6, 7], [8, 9]])
    else:
        doomed, sibling = client.submit("demo-lm", [5, 6, 7]), client.submit("demo-lm", [8, 9])
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    try:
        # taken (its cancel mark read then: none) and held in the window; the heartbeat says so within a beat
        poll_until(lambda: _in_flight(r, worker.hostname) >= 2, 60, "the worker to take both requests")
        # a one-step request the worker holds is seen running only where STARTED is stored for it
        assert client.status(doomed).value == ("running" if track_started else "queued")
        assert client.cancel(doomed) is True
        result = client.result(sibling, wait=True, timeout_s=60)
        # what the worker stored for it (the client answers "cancelled" from the mark alone until then)
        stored = poll_until(lambda: r.get(RESULT_KEY.format(id=doomed)), 60, "the cancelled request's outcome")
    finally:
        r.close()
    meta = json.loads(stored)
    assert (meta["status"], (meta["result"] or {}).get("exc_type")) == ("FAILURE", "RequestCancelled"), meta
    assert isinstance(result, InferenceResult)
    assert result.timings.batch_size == 1  # its batch ran without the cancelled request
    assert client.status(doomed).value == "cancelled"
    with pytest.raises(RequestCancelled, match="cancelled before it ran"):
        client.result(doomed, wait=True, timeout_s=60)


def test_a_settled_cancel_of_a_held_one_step_request_whose_batch_ran_says_false(fleet: Fleet) -> None:
    # No worker: the test writes what a worker with track_started writes (STARTED, then the result once the
    # batch it had started ends) through the fleet's result backend, the result as the cancel is announced.
    client = fleet.client(fleet.config(celery={"track_started": True}))
    rid = client.submit("demo-lm", [5, 6, 7])
    backend = client.app.backend
    backend.store_result(rid, {"pid": 1, "hostname": "w@test"}, states.STARTED)
    result = InferenceResult.model_validate({
        "request_id": rid, "model": "demo-lm", "version": "1", "kind": "next_token", "input_tokens": 3, "top_k": [],
        "timings": {"queue_wait_ms": 1.0, "batch_wait_ms": 1.0, "inference_ms": 1.0, "batch_size": 1,
                    "padded_tokens": 3, "worker": "w@test"}})
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    listener = r.pubsub()
    listener.subscribe(CANCEL_CHANNEL)
    confirmed = listener.get_message(timeout=10)  # Redis's reply: from here on the cancel reaches us
    assert confirmed is not None and confirmed["type"] == "subscribe", confirmed

    def batch_ends_after_the_cancel() -> None:
        while True:
            message = listener.get_message(timeout=1.0)
            if message is not None and message["data"] == rid.encode():
                backend.store_result(rid, result.model_dump(mode="json"), states.SUCCESS)
                return

    writer = threading.Thread(target=batch_ends_after_the_cancel, daemon=True)
    writer.start()
    try:
        assert client.cancel(rid, settle_s=60) is False  # its result won: too late
        writer.join(30)
    finally:
        listener.close()
        r.close()
    assert client.status(rid).value == "succeeded"
