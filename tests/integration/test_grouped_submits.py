"""Grouped submissions (:mod:`producer.submit_groups`, the gateway's :mod:`gateway.submit_queue`): many
callers' one-step requests queued as one ``fleet.infer_bulk`` message per model, each item admitted on
its own and queued all or none, every request answered under its own ID with what a lone ``fleet.infer``
of the same input gives."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis

from producer.submit_groups import SubmitItem, send_group
from protocol.errors import QueueFull, UnknownModel
from protocol.keys import REQUEST_KEY
from protocol.messages import BULK_TASK_NAME, TASK_NAME, InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import GatewayProcess, scrape


def _tasks_in(r: redis.Redis[bytes], queue: str) -> list[str]:
    return [json.loads(raw)["headers"]["task"] for raw in r.lrange(queue, 0, -1)]


def _vector(result: Any) -> list[float]:
    assert isinstance(result, InferenceResult) and result.embedding is not None, result
    return result.embedding


def test_a_group_admits_each_item_alone_and_queues_one_message_per_model(fleet: Fleet) -> None:
    cfg = fleet.config(models={"demo-encoder": {"max_queue_depth": 5}})
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)

    def embed(*seqs: list[int]) -> list[Any]:
        return [client.build_request("demo-encoder", s, kind="embedding") for s in seqs]

    seqs = [[5 + i, 9, 11 + 2 * i] for i in range(8)]
    items = [
        SubmitItem(embed(*seqs[0:3]), "caller-a"),
        SubmitItem(embed(*seqs[3:6]), "caller-b"),  # 3 admitted + 3 > 5: refused, though no queue holds them yet
        SubmitItem(embed(*seqs[6:8]), "caller-c"),
        SubmitItem([client.build_request("demo-lm", [3, 4, 5], top_k=3)], "caller-d"),
        SubmitItem([client.build_request("demo-lm", [3], top_k=3).model_copy(update={"model": "nope"})]),
    ]
    outcomes = send_group(client, items)
    assert isinstance(outcomes[1], QueueFull) and outcomes[1].field == "max_queue_depth"
    assert isinstance(outcomes[4], UnknownModel)
    a, c, d = outcomes[0], outcomes[2], outcomes[3]
    assert isinstance(a, list) and isinstance(c, list) and isinstance(d, list)
    assert len({*a, *c, *d}) == 6
    assert all(r.exists(REQUEST_KEY.format(id=rid)) for rid in [*a, *c, *d])
    assert not any(r.exists(REQUEST_KEY.format(id=str(q.request_id))) for q in items[1].requests)  # nothing of it
    settings = fleet.settings(cfg)
    assert _tasks_in(r, settings.queue_for("demo-encoder")) == [BULK_TASK_NAME]  # a and c: one message
    assert _tasks_in(r, settings.queue_for("demo-lm")) == [TASK_NAME]  # a group of one: a plain task

    fleet.worker(cfg, "demo-encoder")
    fleet.worker(cfg, "demo-lm")
    grouped = client.wait([*a, *c], 120)
    alone = client.wait([client.submit("demo-encoder", s, kind="embedding") for s in [*seqs[0:3], *seqs[6:8]]], 120)
    for g, s in zip(grouped, alone, strict=True):
        assert max(abs(x - y) for x, y in zip(_vector(g), _vector(s), strict=True)) <= 1e-5
    lm = client.result(d[0], wait=True, timeout_s=120)
    assert lm is not None and lm.top_k is not None and lm.request_id == d[0]


@pytest.mark.parametrize("grouping", [True, False])
def test_concurrent_http_callers_each_get_their_own_answer(fleet: Fleet, grouping: bool) -> None:
    """48 native submits and 8 three-input embeddings calls at once through a real gateway: every answer is
    the one a lone FleetClient request gives, under its own ID; grouped or one task each (api.group_submits)."""
    cfg = fleet.config(api={"group_submits": grouping})
    fleet.worker(cfg, "demo-lm")
    fleet.worker(cfg, "demo-encoder")
    client = fleet.client(cfg)
    gateway = GatewayProcess(cfg, fleet.tmp_path / "gateway.log").wait_ready()
    try:
        prompts = [[7 + (i * 13) % 400, 3 + i % 5, 9] for i in range(48)]
        embed_inputs = [[[20 + i, 21, 22 + j] for j in range(3)] for i in range(8)]

        def native(ids: list[int]) -> dict[str, Any]:
            with httpx.Client(base_url=gateway.url, timeout=120) as http:
                posted = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": ids,
                                                         "output": {"top_k": 3}})  # fmt: skip
                assert posted.status_code == 202, posted.text
                view: dict[str, Any] = http.get(posted.headers["Location"], params={"wait_s": 60}).json()
                return view

        def embeddings(inputs: list[list[int]]) -> dict[str, Any]:
            with httpx.Client(base_url=gateway.url, timeout=120) as http:
                answer = http.post("/v1/embeddings", json={"model": "demo-encoder", "input": inputs})
                assert answer.status_code == 200, answer.text
                body: dict[str, Any] = answer.json()
                return body

        with ThreadPoolExecutor(24) as pool:
            views = list(pool.map(native, prompts))
            vectors = list(pool.map(embeddings, embed_inputs))
        assert len({v.get("request_id") for v in views}) == 48, views[:2]
        singles = client.wait([client.submit("demo-lm", p, top_k=3) for p in prompts], 120)
        for view, single in zip(views, singles, strict=True):
            assert view["status"] == "succeeded", view
            assert isinstance(single, InferenceResult) and single.top_k is not None
            assert [t["token_id"] for t in view["result"]["top_k"]] == [t.token_id for t in single.top_k]
        for inputs, body in zip(embed_inputs, vectors, strict=True):
            alone = client.wait([client.submit("demo-encoder", s, kind="embedding") for s in inputs], 120)
            for got, want in zip(body["data"], alone, strict=True):
                assert max(abs(x - y) for x, y in zip(got["embedding"], _vector(want), strict=True)) <= 1e-5
        metrics = scrape(gateway.url + "/metrics")
        grouped = metrics.get(("fleet_gateway_grouped_requests_total", ()), 0.0)
        assert grouped == (48 + 24 if grouping else 0)
    finally:
        gateway.stop()


def test_generations_of_a_group_go_out_in_one_redis_step_a_task_each(fleet: Fleet) -> None:
    """Three callers' generations and two one-step requests in one group: the generations are queued in one
    Redis step as a fleet.infer task each (they stream, and route by prompt), the one-step requests as one
    bulk message; each generation gives what the same request alone gives. Before, the gateway sent each
    generation alone from a thread of its own, so a burst reached the worker over tens of milliseconds."""
    cfg = fleet.config()
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    prompts = [[3 + i, 9, 10] for i in range(3)]
    items = [SubmitItem([client.build_request("demo-lm", p, generation=params)], f"caller-{i}")
             for i, p in enumerate(prompts)]  # fmt: skip
    items += [SubmitItem([client.build_request("demo-lm", [3, 4 + i], top_k=3)]) for i in range(2)]
    outcomes = send_group(client, items)  # the generations: one FleetClient.send_batch (one Redis step)
    assert all(isinstance(o, list) and len(o) == 1 for o in outcomes), outcomes
    assert sorted(_tasks_in(r, fleet.settings(cfg).queue_for("demo-lm"))) == sorted([TASK_NAME] * 3 + [BULK_TASK_NAME])

    fleet.worker(cfg, "demo-lm")
    grouped = client.wait([o[0] for o in outcomes[:3]], 120)  # type: ignore[index]
    alone = client.wait([client.submit("demo-lm", p, generation=params) for p in prompts], 120)
    for g, a in zip(grouped, alone, strict=True):
        assert isinstance(g, InferenceResult) and g.generation is not None and isinstance(a, InferenceResult)
        assert a.generation is not None and g.generation.token_ids == a.generation.token_ids
        assert len(g.generation.token_ids) == 4
