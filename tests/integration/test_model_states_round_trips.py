"""``model_states`` (the MODEL VERSIONS part of ``fleet status``) costs the same round trips with 1 model as with
10, and reads the same rows; so do the whole ``fleet status`` document and the gateway's ``/metrics`` scrape.

Before, every model cost 6 round trips of its own: its state (a ``GET``), its last refusals and all of them (two
``LRANGE``), its canary queue's waiting requests (a script), its auto-rollback counter (a ``GET``) and its last
changes (an ``LRANGE``), after the heartbeats' ``SCAN`` and ``MGET``: 8 for 1 model, 62 for 10 (``fleet status``:
11 and 65; 125 for 20 models). Now one pipeline reads every model's (:func:`producer.model_status.model_states`:
3), and ``fleet status`` hands it the heartbeats it read for its tables (:func:`producer.ops_cli.status_document`:
4, one ``SCAN``). The scrape read each model's state and counter on its own (7 for 1 model, 25 for 10), then
its heartbeats, queues, states and dead letters in 6 round trips; the ``SCAN`` and one pipeline now (2).

Real redis-server; the canary queues hold real kombu messages sent by a plain Celery app (a bulk message among
them, counted as the requests it carries); the states and histories are written by the real changes
(:func:`protocol.model_state.pin`, :func:`~protocol.model_state.set_canary`). Every field of a row is set up to
differ between models: no state, a pin, several pins and a canary (more history entries and refusals than a row
shows, one refusal older than the change), a pin that one of two workers does not serve; the auto-rollback
counter, the canary queue's depth, the workers and what they serve. The rows read are compared with the figures
each model was given. Round trips are counted by a redis-py connection that records each write to its socket.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from celery import Celery
from prometheus_client import CollectorRegistry

from broker import bulk_argsrepr, mark_bulk_queues
from gateway.middleware import GatewayMetrics
from producer.model_status import await_served, model_states
from producer.ops_cli import status_document
from protocol.keys import DEAD_LETTER_COUNTS_KEY, DEAD_LETTER_KEY, WORKER_KEY_PREFIX
from protocol.model_state import AUTO_ROLLBACKS_KEY, REFUSALS_KEY, HistoryEntry, Refusal, pin, set_canary
from protocol.settings import FleetSettings, load_settings
from tests.integration.test_oldest_waiting_one_round_trip import CountingConnection
from tools.redis_server import EmbeddedRedis


def _refuse(r: redis.Redis[bytes], model: str, worker: str, version: str, error_type: str,
            at_unix_s: float) -> Refusal:  # fmt: skip
    """Record a refusal at a chosen time (what :func:`protocol.model_state.record_refusal` stores)."""
    refusal = Refusal(worker=worker, version=version, error=f"{worker} refused {version}", error_type=error_type,
                      at_unix_s=at_unix_s)  # fmt: skip
    r.rpush(REFUSALS_KEY.format(model=model), refusal.model_dump_json())
    return refusal


def _beat(r: redis.Redis[bytes], host: str, model: str, version: str, canary: str | None = None) -> None:
    r.set(WORKER_KEY_PREFIX + host, json.dumps({"hostname": host, "model": model, "version": version,
                                                "canary_version": canary, "ready": True}))  # fmt: skip


def _changes(entries: list[HistoryEntry]) -> list[dict[str, Any]]:
    return [e.model_dump(mode="json", by_alias=True) for e in entries[-3:]]


def _shown(refused: list[tuple[Refusal, str | None]]) -> list[dict[str, Any]]:
    return [{**r.model_dump(mode="json"), "superseded": why} for r, why in refused[-3:]]


def _model(r: redis.Redis[bytes], name: str, i: int) -> dict[str, Any]:
    """Write model ``i``'s state, history, refusals, counter and heartbeats (one of 4 shapes, the figures growing
    with ``i``); returns the row fields it must show but the canary queue's."""
    row: dict[str, Any] = {"stable": None, "canary": None, "canary_weight": 0, "generation": 0, "auto_rollbacks": 0,
                           "last_changes": [], "served": {}, "not_served": None, "last_refusals": [],
                           "stable_manifest_sha256": None, "canary_manifest_sha256": None}  # fmt: skip
    # (the pins below are made without a store: no manifest digest)
    shape, host = (i + 2) % 4, f"w-{i}"
    if shape == 0:  # nothing changed, no worker
        r.set(AUTO_ROLLBACKS_KEY.format(model=name), i)
        return row | {"auto_rollbacks": i}
    if shape == 1:  # a pin its worker serves; a refusal of an earlier version
        entry = pin(r, name, f"1.{i}.0", "test@pin")
        _beat(r, host, name, f"1.{i}.0")
        old = _refuse(r, name, host, f"0.{i}.0", "ModelLoadError", entry.at_unix_s - 50)
        return row | {"stable": f"1.{i}.0", "generation": 1, "last_changes": _changes([entry]),
                      "served": {f"1.{i}.0": [host]},
                      "last_refusals": _shown([(old, f"the desired state is now 1.{i}.0")])}  # fmt: skip
    if shape == 2:  # pins, then a canary no worker loads: more changes and refusals than a row shows
        pins = 2 + i // 4
        entries = [pin(r, name, f"1.{i}.{k}", "test@pin") for k in range(pins)]
        entries.append(set_canary(r, name, f"2.{i}.0", i + 1, "test@canary"))
        since = entries[-1].at_unix_s
        _beat(r, host, name, f"1.{i}.{pins - 1}")
        refused = [_refuse(r, name, f"y-{i}", f"2.{i}.0", "VersionNotFound", since - 1)]  # before the change
        refused += [_refuse(r, name, f"x{j}-{i}", f"2.{i}.0", "ModelLoadError", since + 1 + j) for j in range(pins)]
        refused.append(_refuse(r, name, host, f"2.{i}.0", "ChecksumMismatch", since + 10))
        by = ", ".join([f"{host} (ChecksumMismatch)", *(f"x{j}-{i} (ModelLoadError)" for j in range(pins))])
        r.set(AUTO_ROLLBACKS_KEY.format(model=name), 7 * i)
        return row | {"stable": f"1.{i}.{pins - 1}", "canary": f"2.{i}.0", "canary_weight": i + 1,
                      "generation": pins + 1, "auto_rollbacks": 7 * i, "last_changes": _changes(entries),
                      "served": {f"1.{i}.{pins - 1}": [host]},
                      "not_served": f"canary 2.{i}.0 is not loaded by {host} (their canary queue runs on stable "
                                    f"1.{i}.{pins - 1}); refused by {by}",
                      "last_refusals": _shown([(x, None) for x in refused])}  # fmt: skip
    # shape 3: a pin one of two workers does not serve (it refused it); the other, which refused it before the
    # change, serves it now and still holds a canary the state no longer names
    entry = pin(r, name, f"1.{i}.0", "test@pin")
    other = f"v-{i}"
    _beat(r, host, name, f"1.{i}.0", canary=f"2.{i}.9")
    _beat(r, other, name, f"0.{i}.9")
    early = _refuse(r, name, host, f"1.{i}.0", "ModelLoadError", entry.at_unix_s - 1)
    late = _refuse(r, name, other, f"1.{i}.0", "ChecksumMismatch", entry.at_unix_s + 1)
    r.set(AUTO_ROLLBACKS_KEY.format(model=name), 100 + i)
    return row | {"stable": f"1.{i}.0", "generation": 1, "auto_rollbacks": 100 + i, "last_changes": _changes([entry]),
                  "served": {f"0.{i}.9": [other], f"1.{i}.0": [host]},
                  "not_served": f"desired stable 1.{i}.0 is not served by every worker: {other} serves 0.{i}.9; "
                                f"refused by {other} (ChecksumMismatch)",
                  "last_refusals": _shown([(early, f"{host} now serves 1.{i}.0"), (late, None)])}  # fmt: skip


def _plain_celery(url: str) -> Celery:
    """A plain Celery client (JSON only), as a caller outside the fleet sends with."""
    app = Celery("plain", broker=url)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=False)
    return app


def _fleet(server: EmbeddedRedis, tmp_path: Path, count: int) -> tuple[FleetSettings, dict[str, dict[str, Any]]]:
    """Settings of ``count`` models and a Redis holding different figures for each; returns each model's row."""
    models = {f"model-{i}": {"path": str(tmp_path / f"model-{i}.onnx")} for i in range(count)}
    settings = load_settings("/dev/null", redis_url=server.url, models=models)
    app = _plain_celery(server.url)
    expected: dict[str, dict[str, Any]] = {}
    with server.client() as r:
        r.flushall()
        for i, name in enumerate(models):
            queue = settings.canary_queue_for(name)
            for k in range(i % 3):
                app.send_task("fleet.infer", args=[{"model": name, "input_ids": [5, k]}], queue=queue)
            depth = i % 3
            if (i + 2) % 4 == 2:  # a bulk message of 10 + i requests
                part = [{"request_id": f"bulk-{i}-{k}", "model": name, "input_ids": [5]} for k in range(10 + i)]
                mark_bulk_queues(r, [queue], 600)
                app.send_task("fleet.infer_bulk", args=[{"requests": part}], queue=queue, argsrepr=bulk_argsrepr(part))
                depth += 10 + i
            expected[name] = {"model": name, "canary_queue": queue, "canary_queue_depth": depth} | _model(r, name, i)
    app.close()
    return settings, expected


T = TypeVar("T")

Read = Callable[[FleetSettings, "redis.Redis[bytes]"], list[dict[str, Any]]]
"""What reads the model rows: :func:`producer.model_status.model_states`, or the whole ``fleet status`` document's."""


def _status_rows(settings: FleetSettings, client: redis.Redis[bytes]) -> list[dict[str, Any]]:
    return list(status_document(settings, client)["models"])


def _second_call_round_trips(url: str, call: Callable[[redis.Redis[bytes]], T]) -> tuple[T, list[bytes]]:
    """What ``call`` returns on a client of a counting connection the second time, and its round trips then (each
    one's commands; the first call loads what a client loads on first use, a registered script)."""
    pool = redis.ConnectionPool.from_url(url, connection_class=CountingConnection)
    client: redis.Redis[bytes] = redis.Redis(connection_pool=pool)
    try:
        call(client)
        CountingConnection.writes.clear()
        return call(client), list(CountingConnection.writes)
    finally:
        client.close()


def _round_trips(server: EmbeddedRedis, tmp_path: Path, read: Read, count: int) -> list[bytes]:
    """Round trips of one ``read`` of ``count`` models' rows (each one's commands), once the rows were checked."""
    (tmp_path / f"{count}-models").mkdir()
    settings, expected = _fleet(server, tmp_path / f"{count}-models", count)
    rows, trips = _second_call_round_trips(server.url, lambda client: read(settings, client))
    assert [row["model"] for row in rows] == list(settings.models)
    assert {row["model"]: row for row in rows} == expected
    return trips


@pytest.mark.parametrize("read", [model_states, _status_rows], ids=["model_states", "fleet_status"])
def test_model_rows_cost_the_same_round_trips_for_1_and_10_models(
    redis_server: EmbeddedRedis, tmp_path: Path, read: Read
) -> None:
    one, ten = (_round_trips(redis_server, tmp_path, read, count) for count in (1, 10))
    assert len(ten) == len(one), f"{read.__name__}: {len(one)} round trips for 1 model, {len(ten)} for 10"
    expected = {"model_states": 2, "_status_rows": 4}[read.__name__]  # model_states: the SCAN, then one pipeline
    assert len(one) == expected, f"{read.__name__}: {len(one)} round trips, {expected} expected"
    scans = sum(1 for trip in one if b"\r\nSCAN\r\n" in trip.upper())  # SCAN is sent as a command of its own
    assert scans == 1, f"{read.__name__}: the heartbeats were read {scans} times"  # fleet status: its tables' reading


def test_waiting_for_workers_to_apply_a_state_costs_2_round_trips_a_read(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """``fleet model … --wait``'s poll (:func:`producer.model_status.await_served`) read the state, the heartbeats
    (``SCAN``, ``MGET``) and the refusals apart: 4 round trips a read. Now the ``SCAN`` and one pipeline, and the
    same answer as the model's row in ``fleet status``."""
    settings, rows = _fleet(redis_server, tmp_path, 4)
    for model, row in rows.items():
        answer, trips = _second_call_round_trips(redis_server.url,
                                                 lambda client: await_served(settings, client, model, 0))  # noqa: B023
        assert (answer["served"], answer["not_served"]) == (row["served"], row["not_served"]), model
        assert len(trips) == 2, f"{model}: {len(trips)} round trips for one read"


def _scrape(settings: FleetSettings, client: redis.Redis[bytes]) -> dict[str, dict[str, float]]:
    """The gateway's per-model series of one ``/metrics`` scrape (sample name -> model -> value), and its Redis
    and dead-letter series (sample name -> reason, or "" -> value)."""
    registry = CollectorRegistry()
    GatewayMetrics(registry, settings, client)
    series: dict[str, dict[str, float]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if "model" in sample.labels:
                series.setdefault(sample.name, {})[sample.labels["model"]] = sample.value
            elif sample.name.startswith(("fleet_dead_letter", "fleet_redis_up")):
                series.setdefault(sample.name, {})[sample.labels.get("reason", "")] = sample.value
    return series


def _scrape_round_trips(server: EmbeddedRedis, tmp_path: Path, count: int) -> int:
    """Round trips of one ``/metrics`` scrape of ``count`` models, once its per-model series were checked."""
    (tmp_path / f"{count}-models").mkdir()
    settings, rows = _fleet(server, tmp_path / f"{count}-models", count)
    r = server.client()
    r.delete(DEAD_LETTER_COUNTS_KEY, DEAD_LETTER_KEY)
    r.hset(DEAD_LETTER_COUNTS_KEY, mapping={"malformed": 3, "poison": 1})
    r.rpush(DEAD_LETTER_KEY, b"{}", b"{}", b"{}", b"{}")
    r.close()
    series, trips = _second_call_round_trips(server.url, lambda client: _scrape(settings, client))
    ready = {m: float(sum(len(hosts) for hosts in row["served"].values())) for m, row in rows.items()}  # all ready
    assert series == {
        "fleet_queue_depth": dict.fromkeys(rows, 0.0),
        "fleet_ready_workers": ready,
        "fleet_canary_queue_depth": {m: float(row["canary_queue_depth"]) for m, row in rows.items()},
        "fleet_model_canary_weight": {m: float(row["canary_weight"]) for m, row in rows.items()},
        "fleet_model_auto_rollbacks_total": {m: float(row["auto_rollbacks"]) for m, row in rows.items()},
        "fleet_redis_up": {"": 1.0},
        "fleet_dead_lettered_total": {"malformed": 3.0, "poison": 1.0},
        "fleet_dead_letter_entries": {"": 4.0},
    }
    return len(trips)


def test_a_metrics_scrape_costs_the_same_round_trips_for_1_and_10_models(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """The gateway's ``/metrics`` read each model's state and auto-rollback counter on its own (2 round trips
    per model: 7 for 1 model, 25 for 10), then 6 for either with one ``MGET`` for every model's; now the
    heartbeats' ``SCAN`` and one pipeline for the rest (2 for either)."""
    one, ten = (_scrape_round_trips(redis_server, tmp_path, count) for count in (1, 10))
    assert ten == one == 2, f"/metrics: {one} round trips for 1 model, {ten} for 10"


def test_a_scrape_while_redis_is_down_says_so_and_nothing_else_from_redis(tmp_path: Path) -> None:
    """A scrape that meets a dead Redis (its one pipeline failing) answers ``fleet_redis_up 0`` and leaves out every
    series read from Redis, rather than raising or showing a part of the figures."""
    with EmbeddedRedis() as server:
        settings, _ = _fleet(server, tmp_path, 2)
        client: redis.Redis[bytes] = redis.Redis.from_url(server.url, socket_timeout=2)
        assert _scrape(settings, client)["fleet_redis_up"] == {"": 1.0}
        server.kill()
        try:
            assert _scrape(settings, client) == {"fleet_redis_up": {"": 0.0}}
        finally:
            client.close()
