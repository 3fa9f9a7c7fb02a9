"""A request cancelled while it waits in its queue ends every wait on it at once, on every face.

Before, the cancel only wrote the request's mark (``fleet:cancel:<id>``), which the worker reads as it takes the
request; nothing was published on the result's channel, so each wait went on until a worker reached the
request and stored its cancelled outcome: a long-poll sat out its ``wait_s``, an OpenAI call its
``api.no_worker_wait_s`` and then answered ``no_worker`` (with a worker busy elsewhere: when it got there), a
Python ``result(wait=True)`` its 5 s recheck, ``wait`` and ``stream`` their whole timeout. Now a cancel for good
publishes a wake-up on the result channel (``protocol.cancel_marks.cancel_wake``) and every reader of a result
reads the mark beside it. A plain Celery client, which ignores the wake-up (a state that is not ready), still gets
the outcome the worker stores when it takes the request. Real gateway, real workers, real Redis, no worker
running until the end, so only the cancel can end the waits.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis
from celery import Celery

import producer.result_waiter
from protocol.errors import RequestCancelled
from protocol.keys import REQUEST_KEY, RESULT_KEY
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import API_KEY, OpsFleet, ops_fleet, ops_models, ops_redis, wait_until

__all__ = ["ops_fleet", "ops_models", "ops_redis"]

pytestmark = pytest.mark.timeout(300)
HEADERS = {"X-API-Key": API_KEY}
HANG_S = 120.0
"""How long a test waits for an answer the cancel should bring at once: the old code answered only after 600 s."""


def _listeners(r: redis.Redis[bytes], rid: str) -> int:
    """How many connections listen on ``rid``'s result channel (a waiter subscribes before it reads)."""
    return int(r.pubsub_numsub(RESULT_KEY.format(id=rid))[0][1])


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """``call`` running in a daemon thread; what it returned or raised lands in the dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_cancel_in_the_queue_ends_the_python_waits_at_once_and_celery_clients_still_get_the_outcome(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(producer.result_waiter, "RECHECK_S", 3600.0)  # only the cancel's wake-up can end the wait
    cfg = fleet.config()
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    one_step = client.submit("demo-lm", [5, 6, 7])  # no worker: both wait in the queue
    generation = client.submit("demo-lm", [8, 9], kind="generate", generation={"max_new_tokens": 4})

    waiting, waited = _in_thread(lambda: client.result(one_step, wait=True, timeout_s=600))
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    plain_waiting, plain_waited = _in_thread(lambda: plain.AsyncResult(one_step).get(timeout=600, propagate=False))
    wait_until(lambda: _listeners(r, one_step) >= 2, 60, "both waiters subscribed")

    assert client.cancel(one_step) is True and client.cancel(generation) is True
    waiting.join(HANG_S)
    assert not waiting.is_alive(), "result(wait=True) still waits after its request was cancelled in the queue"
    assert isinstance(waited.get("error"), RequestCancelled), waited
    polled = client.wait([one_step, generation], timeout_s=30)  # polls: the marks are read with the results
    assert all(isinstance(o, RequestCancelled) for o in polled), polled
    events = list(client.stream(generation, timeout_s=30))  # ends from the mark, not a timeout
    assert [e.type for e in events] == ["error"] and events[0].error == "RequestCancelled", events
    assert plain_waiting.is_alive()  # the wake-up is no outcome to Celery: it waits for what a worker stores

    fleet.worker(cfg)  # takes both off the queue, reads their marks, stores why they never ran
    plain_waiting.join(HANG_S)
    assert not plain_waiting.is_alive() and "error" not in plain_waited, plain_waited
    assert plain.AsyncResult(one_step).state == "FAILURE"
    assert type(plain_waited["value"]).__name__ == "RequestCancelled", plain_waited
    for rid in (one_step, generation):  # one terminal state, the same before and after the worker came
        with pytest.raises(RequestCancelled):
            client.result(rid)
        assert json.loads(r.get(RESULT_KEY.format(id=rid)) or b"{}")["status"] == "FAILURE"


def _queued_id(r: redis.Redis[bytes], before: set[bytes]) -> str:
    """The ID of the one request queued since ``before`` (its submit marker ``fleet:req:<id>`` is new)."""
    prefix = REQUEST_KEY.format(id="")

    def new() -> str | None:
        fresh = {key for key in r.scan_iter(match=prefix + "*")} - before
        return fresh.pop().decode()[len(prefix):] if fresh else None

    return str(wait_until(new, 60, "the call's request queued"))


def test_a_cancel_in_the_queue_ends_long_polls_and_openai_calls_at_once(ops_fleet: OpsFleet) -> None:
    config = ops_fleet.config(api={"no_worker_wait_s": 600, "max_wait_s": 600})  # no worker at all
    gw = ops_fleet.gateway(config)
    r = ops_fleet.redis
    with httpx.Client(base_url=gw.url, headers=HEADERS, timeout=HANG_S) as http:
        rid = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5, 6]}).json()["request_id"]
        polling, polled = _in_thread(lambda: http.get(f"/v1/requests/{rid}", params={"wait_s": 600}))
        wait_until(lambda: _listeners(r, rid) >= 1, 60, "the long-poll subscribed")
        assert http.delete(f"/v1/requests/{rid}").json()["status"] == "cancelled"
        polling.join(HANG_S)
        assert "value" in polled, polled  # before: the long-poll sat out its 600 s (an httpx timeout here)
        assert polled["value"].json()["status"] == "cancelled", polled["value"].text

        before = set(r.scan_iter(match=REQUEST_KEY.format(id="") + "*"))
        chat = {"model": "demo-lm", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        calling, called = _in_thread(lambda: http.post("/v1/chat/completions", json=chat))
        chat_id = _queued_id(r, before)
        assert http.delete(f"/v1/requests/{chat_id}").json()["status"] == "cancelled"
        calling.join(HANG_S)
        assert "value" in called, called  # before: 600 s, then 503 no_worker, a wrong reason
        answer = called["value"]
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "cancelled", answer.text
        assert answer.headers["X-Request-ID"] == chat_id

        with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as streamed:
            assert streamed.status_code == 200
            stream_id = streamed.headers["X-Request-ID"]
            assert http.delete(f"/v1/requests/{stream_id}").json()["status"] == "cancelled"
            frames = [line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["code"] == "cancelled", frames
        for cancelled in (rid, chat_id, stream_id):
            assert http.get(f"/v1/requests/{cancelled}").json()["status"] == "cancelled"

