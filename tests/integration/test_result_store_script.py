"""The worker's one-script result store (``broker.result_backend``) against a real redis-server: Celery's
rules (keep a SUCCESS, publish what is stored, the failure TTL) in one round trip and 3 commands."""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from celery import states

from bench.procs import redis_commandstats
from broker import make_celery, result_backend
from protocol.celeryconf import celery_config
from protocol.settings import load_settings
from tools.redis_server import EmbeddedRedis

PROBE = {"info", "hello", "client"}  # redis_commandstats's own connection


def _backend(url: str, **conf: Any) -> Any:
    app = make_celery(celery_config(load_settings(redis_url=url)), "store-script-test")
    result_backend.install(app)
    app.conf.update(conf)
    backend = app.backend
    assert isinstance(backend, result_backend.RefusalTolerantRedisBackend)
    return backend


def _calls(url: str, before: dict[str, int]) -> dict[str, int]:
    after = redis_commandstats(url)
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) and k not in PROBE}


def test_a_result_is_stored_and_published_in_one_script(redis_server: EmbeddedRedis) -> None:
    backend = _backend(redis_server.url)
    r = redis.Redis(port=redis_server.port)
    listener = r.pubsub()
    listener.subscribe(backend.get_key_for_task("t1"))
    confirmed = listener.get_message(timeout=10)  # Redis's reply: from here on the publication reaches us
    assert confirmed is not None and confirmed["type"] == "subscribe", confirmed
    backend.store_result("t0", {"warm": 1}, states.SUCCESS)  # loads the script
    before = redis_commandstats(redis_server.url)
    backend.store_result("t1", {"n": 1}, states.SUCCESS)
    # the expires: the marker's and the owner mark's; the del: the take's note (protocol.cancel_marks)
    assert _calls(redis_server.url, before) == {"evalsha": 1, "set": 1, "expire": 2, "publish": 1, "del": 1}
    stored = json.loads(r.get(backend.get_key_for_task("t1")) or b"{}")
    assert stored["status"] == "SUCCESS" and stored["result"] == {"n": 1} and stored["task_id"] == "t1"
    assert 0 < r.ttl(backend.get_key_for_task("t1")) <= backend.expires
    deadline = time.monotonic() + 5
    message = None
    while message is None and time.monotonic() < deadline:
        message = listener.get_message(timeout=0.5)
    assert message is not None and json.loads(message["data"])["status"] == "SUCCESS"


def test_a_success_is_kept_and_an_earlier_state_is_overwritten(redis_server: EmbeddedRedis) -> None:
    backend = _backend(redis_server.url, result_failure_expires=30)
    r = redis.Redis(port=redis_server.port)
    key = backend.get_key_for_task("t2")
    backend.store_result("t2", {"pid": 1}, states.STARTED)  # a generation's STARTED...
    backend.store_result("t2", {"n": 2}, states.SUCCESS)  # ...is overwritten by its result
    before = redis_commandstats(redis_server.url)
    backend.store_result("t2", None, states.FAILURE)  # a redelivered copy failing late: SUCCESS is kept
    calls = _calls(redis_server.url, before)
    assert calls.get("publish", 0) == 0 and calls["evalsha"] == 1
    assert json.loads(r.get(key) or b"{}")["status"] == "SUCCESS"
    backend.store_result("t3", None, states.FAILURE)  # a failure lives result_failure_expires seconds
    assert 0 < r.ttl(backend.get_key_for_task("t3")) <= 30
    r.set(backend.get_key_for_task("t4"), b"not json")  # unreadable state: overwritten, as Celery would
    backend.store_result("t4", {"n": 4}, states.SUCCESS)
    assert json.loads(r.get(backend.get_key_for_task("t4")) or b"{}")["status"] == "SUCCESS"


def test_no_stored_outcome_is_ever_replaced(redis_server: EmbeddedRedis) -> None:
    """A stored FAILURE or REVOKED is kept as a SUCCESS is: a stray copy of a failed request (a duplicate task
    ID, an expired copy, a poison copy dead-lettered) must not turn a request a client saw fail into one that
    succeeded, nor a STARTED overwrite an outcome."""
    backend = _backend(redis_server.url)
    r = redis.Redis(port=redis_server.port)
    for task_id, first in (("f1", states.FAILURE), ("r1", states.REVOKED)):
        backend.store_result(task_id, ValueError("first") if first == states.FAILURE else None, first)
        for later, value in ((states.SUCCESS, {"n": 1}), (states.FAILURE, ValueError("later")),
                             (states.STARTED, {"pid": 1})):  # fmt: skip
            backend.store_result(task_id, value, later)
            assert json.loads(r.get(backend.get_key_for_task(task_id)) or b"{}")["status"] == first


def test_many_results_are_stored_in_one_pipeline_by_the_same_rule(redis_server: EmbeddedRedis) -> None:
    backend = _backend(redis_server.url)
    r = redis.Redis(port=redis_server.port)
    backend.store_result("kept", {"n": 0}, states.SUCCESS)
    written = backend.store_many([("kept", states.SUCCESS, {"n": 9}), ("new", states.SUCCESS, {"n": 1}),
                                  ("bad", states.FAILURE, ValueError("no"))])  # fmt: skip
    assert written == 2
    assert json.loads(r.get(backend.get_key_for_task("kept")) or b"{}")["result"] == {"n": 0}
    assert json.loads(r.get(backend.get_key_for_task("new")) or b"{}")["result"] == {"n": 1}
    failed = json.loads(r.get(backend.get_key_for_task("bad")) or b"{}")
    assert failed["status"] == "FAILURE" and failed["result"]["exc_type"] == "ValueError"
