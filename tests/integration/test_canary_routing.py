"""Canary routing: the producer splits a model's traffic by role queue, sticky by key, and a real
fleet serves the canary share from the canary version (two versions published on a real S3 server)."""

from __future__ import annotations

import base64
import json
from collections import Counter, defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from producer.client import FleetClient
from protocol.messages import InferenceResult
from protocol.model_state import ModelState, pin, read_state, route, set_canary
from protocol.settings import FleetSettings
from tests.integration.canary_fixtures import MODEL, publish_two_versions, wait_canary_served
from tests.integration.fleet_fixtures import Fleet
from tools.seaweed_server import EmbeddedSeaweed


def _queued_request_ids(client: FleetClient, queue: str) -> list[str]:
    """The request IDs inside the bulk messages waiting on ``queue`` (Celery protocol 2, JSON body)."""
    ids: list[str] = []
    for raw in client.redis.lrange(queue, 0, -1):
        body = json.loads(base64.b64decode(json.loads(raw)["body"]))
        ids.extend(item["request_id"] for item in body[0][0]["requests"])
    return ids


def _with_canary(fleet: Fleet, weight: int) -> tuple[FleetSettings, FleetClient, ModelState | None]:
    """Settings, a client, and the state after pinning 1.0.0 with canary 2.0.0 at ``weight`` percent."""
    cfg = fleet.config()
    client = fleet.client(cfg)
    pin(client.redis, MODEL, "1.0.0", "test@host")
    set_canary(client.redis, MODEL, "2.0.0", weight, "test@host")
    return fleet.settings(cfg), client, read_state(client.redis, MODEL)


def test_producer_queues_each_request_on_the_role_its_key_routes_to(fleet: Fleet) -> None:
    settings, client, state = _with_canary(fleet, 10)
    ids = client.submit_bulk(MODEL, [[5 + i % 50] for i in range(2000)], chunk_size=500, top_k=1)
    on_canary = _queued_request_ids(client, settings.canary_queue_for(MODEL))
    on_stable = _queued_request_ids(client, settings.queue_for(MODEL))
    assert sorted(on_canary + on_stable) == sorted(ids)
    assert set(on_canary) == {rid for rid in ids if route(state, rid) == "canary"}
    assert abs(len(on_canary) / len(ids) - 0.10) <= 0.03


def test_split_90_10_over_2000_requests_and_sticky_keys_on_a_real_fleet(
    fleet: Fleet, s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path
) -> None:
    cfg, store, v1, v2 = publish_two_versions(fleet, s3, model_dir, tmp_path)
    fleet.worker(cfg)
    client = fleet.client(cfg)
    pin(client.redis, MODEL, v1, "test@host", store=store)
    set_canary(client.redis, MODEL, v2, 10, "test@host", store=store)
    wait_canary_served(client, v2)

    ids = client.submit_bulk(MODEL, [[5 + i % 50] for i in range(2000)], chunk_size=250, top_k=1)
    results = client.wait(ids, 240)
    versions = Counter(r.version for r in results if isinstance(r, InferenceResult))
    assert sum(versions.values()) == len(ids)
    share = versions[v2] / len(ids)
    print(f"canary share over {len(ids)} requests at weight 10: {share:.4f} ({dict(versions)})")
    assert abs(share - 0.10) <= 0.03
    roles = Counter(r.model_dump().get("role") for r in results if isinstance(r, InferenceResult))
    assert roles["canary"] == versions[v2]

    # a repeated routing key always lands on the same version (weight 50: both versions get keys)
    set_canary(client.redis, MODEL, v2, 50, "test@host", store=store)
    state = read_state(client.redis, MODEL)
    sticky = fleet.client(cfg)  # a fresh producer: its state cache holds the new split
    keys = [f"session-{k}" for k in range(20)]
    sent = [(keys[i % 20], sticky.submit(MODEL, [7, 8], routing_key=keys[i % 20], top_k=1)) for i in range(200)]
    got = sticky.wait([rid for _, rid in sent], 120)
    per_key: dict[str, set[str]] = defaultdict(set)
    for (key, _), res in zip(sent, got, strict=True):
        assert isinstance(res, InferenceResult)
        per_key[key].add(res.version)
    assert all(len(served) == 1 for served in per_key.values()), per_key
    assert {next(iter(served)) for served in per_key.values()} == {v1, v2}
    for key, served in per_key.items():
        assert served == {v2 if route(state, key) == "canary" else v1}


def _queued_single_ids(client: FleetClient, queue: str) -> set[str]:
    """Task IDs of the fleet.infer messages waiting on ``queue``."""
    return {json.loads(raw)["headers"]["id"] for raw in client.redis.lrange(queue, 0, -1)}


def test_gateway_routes_by_the_bodys_routing_key(fleet: Fleet) -> None:
    from fastapi.testclient import TestClient

    from gateway.app import create_app

    settings, client, state = _with_canary(fleet, 50)
    keys = [f"user-{k}" for k in range(10)]
    with TestClient(create_app(settings)) as http:
        sent = []
        for i in range(30):
            body = {"model": MODEL, "input_ids": [5, 6], "routing_key": keys[i % 10]}
            resp = http.post("/v1/requests", json=body)
            assert resp.status_code == 202, resp.text
            sent.append((keys[i % 10], resp.json()["request_id"]))
        batch = http.post("/v1/requests:batch", json={"requests": [
            {"model": MODEL, "input_ids": [5], "routing_key": key} for key in keys]})
        assert batch.status_code == 202, batch.text
        sent += [(key, item["request_id"]) for key, item in zip(keys, batch.json()["requests"], strict=True)]
        too_long = http.post("/v1/requests", json={"model": MODEL, "input_ids": [5], "routing_key": "k" * 201})
        assert too_long.status_code == 422 and "routing_key" in too_long.text
        client.redis.set("fleet:model-auto-rollbacks:demo-lm", 2)
        metrics = {(s.name, s.labels.get("model")): s.value
                   for family in text_string_to_metric_families(http.get("/metrics").text) for s in family.samples}
    on_canary = _queued_single_ids(client, settings.canary_queue_for(MODEL))
    on_stable = _queued_single_ids(client, settings.queue_for(MODEL))
    assert on_canary | on_stable == {rid for _, rid in sent} and not on_canary & on_stable
    for key, rid in sent:
        assert (rid in on_canary) == (route(state, key) == "canary")
    assert 0 < len(on_canary) < len(sent)
    assert metrics[("fleet_canary_queue_depth", MODEL)] == len(on_canary)
    assert metrics[("fleet_queue_depth", MODEL)] == len(on_stable)
    assert metrics[("fleet_model_canary_weight", MODEL)] == 50
    assert metrics[("fleet_model_auto_rollbacks_total", MODEL)] == 2
    assert metrics[("fleet_model_canary_weight", "demo-encoder")] == 0
