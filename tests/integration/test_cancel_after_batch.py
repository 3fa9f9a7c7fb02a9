"""A cancel that comes after a worker took a one-step request never reads as "cancelled" when the request then
ends with its result: every request ID reaches one terminal state (real redis-server, real worker, real ONNX
Runtime; ``hold_result_plugin`` holds the result back between the batch's run and its store).

Before, a cancel was a mark every reader took for "cancelled" as soon as it was set: a request whose batch had
run read ``cancelled`` (``status``, ``GET /v1/requests/<id>``, ``DELETE``'s own answer, a waiting
``result(wait=True)`` that raised ``RequestCancelled``), then ``succeeded`` once the worker stored its result.
Now the worker notes each take, and a cancel after it is asked of that worker (``protocol.cancel_marks``).
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
import redis

from gateway.views import read_view_sync
from producer.client import FleetClient
from protocol.cancel_marks import HELD
from protocol.keys import CANCEL_KEY, TAKEN_KEY
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tests.integration.hold_result_plugin import HOLD_PREFIX, RAN_KEY, RELEASE_KEY
from tests.integration.redis_monitor import Monitor
from tools.processes import WorkerProcess, poll_until


def _holding_worker(fleet: Fleet, config: Path) -> WorkerProcess:
    """A real demo-lm worker that holds back the results of ``hold-`` requests until released."""
    return fleet.worker(config, hostname=f"h{len(fleet.workers) + 1}-demo-lm@test",
                        include="tests.integration.hold_result_plugin")


def _submit(client: FleetClient, bulk: bool) -> str:
    rid = f"{HOLD_PREFIX}{uuid.uuid4().hex}"
    if bulk:
        client.submit_bulk("demo-lm", [[5, 6, 7]], request_ids=[rid])
    else:
        client.submit("demo-lm", [5, 6, 7], request_id=rid)
    return rid


@pytest.mark.parametrize("bulk", [False, True], ids=["infer", "infer_bulk"])
def test_a_cancel_after_the_batch_ran_never_reads_cancelled_and_the_result_is_the_one_outcome(
    fleet: Fleet, bulk: bool
) -> None:
    cfg = fleet.config()
    _holding_worker(fleet, cfg)
    client = fleet.client(cfg)
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    monitor = Monitor(fleet.redis_url)
    rid = _submit(client, bulk)
    poll_until(lambda: r.exists(RAN_KEY.format(id=rid)), 60, "the request's batch to run")
    waited: list[object] = []
    waiter = threading.Thread(target=lambda: waited.append(_outcome(client, rid)), daemon=True)
    seen = [client.status(rid).value]
    try:
        assert client.cancel(rid) is True  # asked of the worker that holds it
        assert r.get(CANCEL_KEY.format(id=rid)) == HELD.encode()
        seen += [client.status(rid).value, read_view_sync(client, rid)[0].status.value]
        # a wait begun after the cancel, while the worker holds the request: released once it has read the mark
        # (or ended: before, its first read took the mark for "cancelled")
        before = len(monitor.up_to_now())
        waiter.start()
        mark = CANCEL_KEY.format(id=rid)
        poll_until(lambda: not waiter.is_alive() or any(c["command"] in (f"GET {mark}", f"EXISTS {mark}")
                                                        for c in monitor.commands[before:]),
                   60, "the wait's first read of the cancel mark")  # fmt: skip
    finally:
        r.set(RELEASE_KEY.format(id=rid), "1")
    waiter.join(60)
    result = client.result(rid, wait=True, timeout_s=60)
    seen.append(client.status(rid).value)
    print(f"\nstatuses read: {seen}; the waiter got {type(waited[0]).__name__ if waited else None}")
    assert "cancelled" not in seen, seen
    assert seen[-1] == "succeeded" and isinstance(result, InferenceResult)
    assert waited and isinstance(waited[0], InferenceResult), waited  # the wait begun after the cancel: the result
    assert not r.exists(TAKEN_KEY.format(id=rid))  # the take's note goes with the stored outcome


def _outcome(client: FleetClient, rid: str) -> object:
    try:
        return client.result(rid, wait=True, timeout_s=60)
    except Exception as exc:  # the test reads what it was
        return exc


def test_a_settled_cancel_of_a_request_whose_batch_ran_says_false(fleet: Fleet) -> None:
    """``DELETE /v1/requests/<id>`` settles its cancel (``cancel(settle_s=…)``): where the result wins it answers
    409, not the view of a cancelled request. Before, without ``celery.track_started``, it answered True at once."""
    cfg = fleet.config()
    _holding_worker(fleet, cfg)
    client = fleet.client(cfg)
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    rid = _submit(client, bulk=False)
    poll_until(lambda: r.exists(RAN_KEY.format(id=rid)), 60, "the request's batch to run")

    def release_once_cancelled() -> None:
        poll_until(lambda: r.exists(CANCEL_KEY.format(id=rid)), 60, "the cancel mark")
        r.set(RELEASE_KEY.format(id=rid), "1")

    releaser = threading.Thread(target=release_once_cancelled, daemon=True)
    releaser.start()
    try:
        assert client.cancel(rid, settle_s=60) is False  # its result won: too late
    finally:
        r.set(RELEASE_KEY.format(id=rid), "1")
        releaser.join(60)
    assert client.status(rid).value == "succeeded"
