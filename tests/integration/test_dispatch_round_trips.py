"""Fewer Redis commands per submission, same guarantees: against a real redis-server (no worker, so the
queue length is the truth).

A producer reads a queue's depth once per ``admission.queue_depth_cache_ms`` and adds what it admitted
since; it still refuses at the cap, and a known ID still answers with its ID there.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from bench.procs import redis_commandstats
from producer.admission import Admission
from protocol.errors import QueueFull
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tests.integration.redis_monitor import Monitor


def test_submit_reads_the_depth_once_per_window_and_still_refuses_at_the_cap(fleet: Fleet) -> None:
    cfg = fleet.config(models={"demo-lm": {"max_queue_depth": 6}}, admission={"queue_depth_cache_ms": 1000})
    client = fleet.client(cfg)
    client.admission = Admission(client.redis, client.settings, monotonic=lambda: 50.0)  # the window never ends
    client.router.clock = lambda: 50.0  # nor does the routing state's (one GET per second otherwise)
    queue = client.settings.queue_for("demo-lm")
    r = redis.Redis.from_url(fleet.redis_url)
    client.submit("demo-lm", [1])  # connections, scripts and the result subscription are set up here
    before = redis_commandstats(fleet.redis_url)
    ids = [client.submit("demo-lm", [2, i + 3]) for i in range(5)]
    after = redis_commandstats(fleet.redis_url)
    calls = {k: v - before.get(k, 0) for k, v in after.items()}
    assert calls.get("llen", 0) == 0  # the first submission's read still holds: 1 + 5 = the cap
    assert calls.get("get", 0) == 0  # no look-up before the claim: one script run per submission
    assert calls["evalsha"] == 5 and calls["set"] == 5 and calls["exists"] == 5 and calls["lpush"] == 5
    with pytest.raises(QueueFull) as info:  # the estimate would pass the cap: a fresh read refuses
        client.submit("demo-lm", [9])
    assert info.value.limit == 6 and info.value.field == "max_queue_depth"
    assert client.submit("demo-lm", [2, 3], request_id=ids[0]) == ids[0]  # a known ID is not refused
    assert r.llen(queue) == 6


def test_a_second_producer_reads_its_own_depth_and_is_refused_at_the_cap(fleet: Fleet) -> None:
    cfg = fleet.config(models={"demo-lm": {"max_queue_depth": 3}}, admission={"queue_depth_cache_ms": 1000})
    first, second = fleet.client(cfg), fleet.client(cfg)
    for i in range(3):
        first.submit("demo-lm", [i + 1])
    with pytest.raises(QueueFull):
        second.submit("demo-lm", [7])
    assert redis.Redis.from_url(fleet.redis_url).llen(first.settings.queue_for("demo-lm")) == 3


def test_waiting_on_a_result_subscribes_once_and_sending_does_not(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    client.result(client.submit("demo-lm", [1, 2]), wait=True, timeout_s=60)  # connections set up
    before = redis_commandstats(fleet.redis_url)

    def one(i: int) -> InferenceResult | None:
        return client.result(client.submit("demo-lm", [3, i + 4]), wait=True, timeout_s=60)

    with ThreadPoolExecutor(2) as pool:  # Celery keeps a result backend per thread: each must be quiet
        results = list(pool.map(one, range(4)))
    after = redis_commandstats(fleet.redis_url)
    calls = {k: v - before.get(k, 0) for k, v in after.items()}
    assert [r.input_tokens for r in results if r is not None] == [2, 2, 2, 2]
    assert calls["subscribe"] == 4 and calls["unsubscribe"] == 4  # one of each per wait, none per send
    late = client.submit("demo-lm", [5, 6])  # a result stored before anyone waits is still read
    fleet_done = client.wait([late], timeout_s=60)[0]
    got = client.result(late, wait=True, timeout_s=60)
    assert got is not None and got == fleet_done


def test_started_is_stored_for_generations_only(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    client.result(client.submit("demo-lm", [1, 2]), wait=True, timeout_s=60)  # connections set up

    def stores_during(generation: dict[str, int | bool] | None = None) -> int:
        """State writes of one request: each is one run of the worker's store script (broker.result_backend),
        seen in Redis's MONITOR as the run's first command, a ``SET <state key> <meta> NX`` inside a script (a
        run that finds a state already stored writes it again with a plain SET, not counted). Counted by key,
        not as script runs in a window: the worker's heartbeat script runs every 0.5 s and may fall in it."""
        monitor = Monitor(fleet.redis_url)
        try:
            rid = client.submit("demo-lm", [3, 4], generation=generation)
            assert client.result(rid, wait=True, timeout_s=60) is not None
            commands = monitor.up_to_now()
        finally:
            monitor.close()
        key = f"celery-task-meta-{rid}"
        return sum(1 for c in commands if c["client_type"] == "lua" and c["command"].startswith(f"SET {key} ")
                   and re.search(r" NX( EX \d+)?$", c["command"]))

    assert stores_during() == 1  # the result only: a one-step request goes from queued to its result
    # STARTED, then the result (not streamed: a stream's events are runs of the publisher's write script)
    assert stores_during(generation={"max_new_tokens": 3, "stream": False}) == 2
