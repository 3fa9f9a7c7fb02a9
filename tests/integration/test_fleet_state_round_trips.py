"""``read_fleet_state`` (``fleet status``, the gateway's ``/v1/models`` and ``/readyz``) costs the same round trips
with 1 model as with 10, and reads the same figures.

Before, every model cost round trips of its own: its drain counters (an ``MGET``), its direct-queue registry (a
``ZRANGE``) and its direct queues' lengths (a pipeline), and its published card (a ``GET``): 7 round trips for 1
model, 38 for 10, 74 for 20, per ``fleet status`` and per gateway call that reads the state. Now one pipeline reads
every model's figures and a second the direct queues those name (:func:`producer.registry.read_fleet_state`).

Real redis-server; the queued messages are real kombu messages sent by a plain Celery app; every figure a model
row holds is set up with a different value per model (depth, oldest waiting, drain rate, card version from the
configuration, a card file, the card a worker published or none; direct queues of a live worker, of a dead
registered one and of a stranger's, which does not count), and the rows read are compared with those values.
Round trips are counted by a redis-py connection that records each write to its socket.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from producer.registry import ModelState, read_fleet_state
from protocol.keys import CARD_KEY, DIRECT_QUEUES_KEY, DRAIN_KEY, WORKER_KEY_PREFIX
from protocol.settings import FleetSettings, load_settings
from tests.integration.test_oldest_waiting_one_round_trip import CountingConnection
from tools.redis_server import EmbeddedRedis

NOW_S = 1_900_000_000.0
"""The status's clock (unix s): request stamps and drain counters are set against it."""


def _card(name: str, version: str) -> dict[str, Any]:
    return {"name": name, "version": version, "kind": "encoder", "vocab_size": 64, "max_positions": 32,
            "num_layers": 1, "num_heads": 1, "head_dim": 8, "hidden_size": 8}  # fmt: skip


def _fleet(server: EmbeddedRedis, tmp_path: Path, count: int) -> tuple[FleetSettings, dict[str, dict[str, Any]]]:
    """Settings of ``count`` models and a Redis holding a different figure of each per model; returns the figures
    each model's row must show."""
    models: dict[str, dict[str, Any]] = {}
    for i in range(count):
        models[f"model-{i}"] = {"path": str(tmp_path / f"model-{i}.onnx")} | ({"version": f"9.0.{i}"} if i % 4 == 0
                                                                               else {})  # fmt: skip
    settings = load_settings("/dev/null", redis_url=server.url, models=models)
    app = Celery("plain", broker=server.url)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=False)
    expected: dict[str, dict[str, Any]] = {}
    with server.client() as r:
        r.flushall()
        for i, name in enumerate(models):
            queue, host = settings.queue_for(name), f"host-{i}"
            for k in range(i):  # model i: i requests waiting, the oldest 100 * i s old
                app.send_task("fleet.infer", args=[{"model": name, "input_ids": [5], "submitted_at_unix_s":
                                                    NOW_S - 100.0 * i + k}], queue=queue)  # fmt: skip
            r.set(DRAIN_KEY.format(model=name, second=int(NOW_S) - 2), 6 * (i + 1))  # over 3 s: 2 (i + 1) req/s
            r.set(WORKER_KEY_PREFIX + host, json.dumps({"hostname": host, "model": name, "ready": i % 2 == 0,
                                                        "in_flight": i}))  # fmt: skip
            r.zadd(DIRECT_QUEUES_KEY.format(model=name), {host: 1, f"dead-{i}": 1})
            r.lpush(settings.direct_queue_for(name, host), *[b"m"] * (i + 1))
            r.lpush(settings.direct_queue_for(name, f"dead-{i}"), b"m", b"m")
            r.lpush(settings.direct_queue_for(name, f"stranger-{i}"), *[b"m"] * 5)  # neither live nor registered
            version = {0: f"9.0.{i}", 1: f"1.{i}.0", 2: f"2.{i}.0", 3: None}[i % 4]
            if i % 4 == 1:
                (tmp_path / f"model-{i}.json").write_text(json.dumps(_card(name, f"1.{i}.0")))
            elif i % 4 == 2:
                r.set(CARD_KEY.format(model=name), json.dumps(_card(name, f"2.{i}.0")))
            expected[name] = {"queue": queue, "depth": i, "oldest_waiting_s": 100.0 * i if i else None,
                              "drain_rate_per_s": 2.0 * (i + 1), "configured_version": version,
                              "direct_depth": i + 3, "workers": [host], "ready_workers": 1 - i % 2}  # fmt: skip
    app.close()
    return settings, expected


def _row(m: ModelState) -> dict[str, Any]:
    return {"queue": m.queue, "depth": m.depth, "oldest_waiting_s": m.oldest_waiting_s,
            "drain_rate_per_s": m.drain_rate_per_s, "configured_version": m.configured_version,
            "direct_depth": m.direct_depth, "workers": [w["hostname"] for w in m.workers],
            "ready_workers": m.ready_workers}  # fmt: skip


def _round_trips(server: EmbeddedRedis, tmp_path: Path, count: int) -> int:
    """Round trips of one ``read_fleet_state`` of ``count`` models, once its rows were checked."""
    folder = tmp_path / f"{count}-models"
    folder.mkdir()
    settings, expected = _fleet(server, folder, count)
    pool = redis.ConnectionPool.from_url(server.url, connection_class=CountingConnection)
    client: redis.Redis[bytes] = redis.Redis(connection_pool=pool)
    try:
        read_fleet_state(settings, client, now_s=NOW_S)  # a script a client loads on first use is loaded
        CountingConnection.writes.clear()
        state = read_fleet_state(settings, client, now_s=NOW_S)
        trips = len(CountingConnection.writes)
    finally:
        client.close()
    assert state.redis_error is None, state.redis_error
    assert {m.name: _row(m) for m in state.models} == expected
    assert sorted(w["hostname"] for w in state.workers) == sorted(f"host-{i}" for i in range(count))
    return trips


def test_the_fleet_state_costs_the_same_round_trips_for_1_and_10_models(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    one, ten = _round_trips(redis_server, tmp_path, 1), _round_trips(redis_server, tmp_path, 10)
    assert ten == one, f"read_fleet_state: {one} round trips for 1 model, {ten} for 10"
