"""The HTTP gateway over real HTTP: a real ``fleet api`` process, a real worker, real Redis.

One gateway and one demo-lm worker serve the whole module; demo-encoder is configured but has no
worker, so its requests stay queued (what cancel needs) and /v1/models shows it not ready.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

# Schemathesis imports its OpenAPI machinery lazily, and as a pytest plugin its modules are assertion-rewritten
# (ast.parse) on import. Import it at collection, before fixtures start threads and leave objects for the
# garbage collector: CI once failed inside that import with CPython 3.11's "AST constructor recursion depth
# mismatch" (python/cpython#106905) while a finalizer was retrying a stopped Redis.
from schemathesis.specs.openapi.schemas import OpenApiSchema  # noqa: F401

from protocol.keys import REQUEST_ID_PATTERN
from tests.integration.ops_fixtures import (
    API_KEY,
    ROOT,
    GatewayProcess,
    OpsFleet,
    ops_models,
    ops_redis,
    scrape,
    wait_until,
)
from tools.processes import WorkerProcess
from tools.redis_server import EmbeddedRedis, free_port

__all__ = ["ops_models", "ops_redis"]

AUTH = {"X-API-Key": API_KEY}


@dataclass
class Served:
    fleet: OpsFleet
    gateway: GatewayProcess
    worker: WorkerProcess
    worker_metrics: str
    http: httpx.Client


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis) -> Iterator[Served]:
    fleet = OpsFleet(tmp_path_factory.mktemp("gateway"), ops_models, ops_redis)
    try:
        config = fleet.config()
        port = free_port()
        worker = fleet.worker(config, metrics_port=port)
        gateway = fleet.gateway(config)
        with httpx.Client(base_url=gateway.url, headers=AUTH, timeout=10) as http:
            yield Served(fleet, gateway, worker, f"http://127.0.0.1:{port}/metrics", http)
    finally:
        fleet.close()


def _poll_done(http: httpx.Client, rid: str, timeout_s: float = 30) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        doc: dict[str, Any] = http.get(f"/v1/requests/{rid}").json()
        return doc if doc["status"] not in ("queued", "running") else None

    result: dict[str, Any] = wait_until(done, timeout_s, f"request {rid} to finish")
    return result


def test_submit_poll_result(served: Served) -> None:
    http = served.http
    resp = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5, 6, 7], "output": {"top_k": 3}})
    assert resp.status_code == 202, resp.text
    rid = resp.json()["request_id"]
    assert resp.headers["Location"] == f"/v1/requests/{rid}" == resp.json()["location"]
    doc = _poll_done(http, rid)
    assert doc["status"] == "succeeded" and doc["error"] is None
    result = doc["result"]
    assert result["request_id"] == rid and result["model"] == "demo-lm" and result["version"] == "1.0.0"
    assert len(result["top_k"]) == 3 and result["input_tokens"] == 3
    assert result["timings"]["worker"] == served.worker.hostname

    by_text = http.post("/v1/requests", json={"model": "demo-lm", "text": "hi", "request_id": "text-1"})
    assert by_text.status_code == 202 and by_text.json()["request_id"] == "text-1"
    assert _poll_done(http, "text-1")["result"]["input_tokens"] == 2
    again = http.post("/v1/requests", json={"model": "demo-lm", "text": "hi", "request_id": "text-1"})
    assert again.status_code == 202  # idempotent: the known ID with the same body is not queued twice
    assert again.json()["status"] == "succeeded"  # and it answers its real status, not "queued"
    other = http.post("/v1/requests", json={"model": "demo-lm", "text": "other", "request_id": "text-1"})
    assert other.status_code == 409 and other.json()["error"] == "idempotency_conflict"  # another body: refused
    assert _poll_done(http, "text-1")["result"]["input_tokens"] == 2


def test_batch_submit_is_all_or_nothing(served: Served) -> None:
    http = served.http
    items = [
        {"model": "demo-lm", "input_ids": [1, 2, 3], "request_id": "b-1"},
        {"model": "demo-lm", "text": "batch", "request_id": "b-2"},
        {"model": "demo-lm", "input_ids": [9] * 10, "output": {"top_k": 1}, "request_id": "b-3"},
    ]
    bad = [*items[:1], {"model": "demo-lm", "input_ids": [1] * 65, "request_id": "bad-2"}]
    refused = http.post("/v1/requests:batch", json={"requests": bad})
    assert refused.status_code == 422
    assert refused.json()["field"] == "requests[1].input_ids" and "max_input_tokens=64" in refused.json()["message"]
    assert http.get("/v1/requests/b-1").status_code == 404  # nothing of the refused batch was queued

    resp = http.post("/v1/requests:batch", json={"requests": items})
    assert resp.status_code == 202, resp.text
    ids = [r["request_id"] for r in resp.json()["requests"]]
    assert ids == ["b-1", "b-2", "b-3"]
    docs = [_poll_done(http, rid) for rid in ids]
    assert [d["status"] for d in docs] == ["succeeded"] * 3
    assert [d["result"]["input_tokens"] for d in docs] == [3, 5, 10]


def test_cancel_a_queued_request(served: Served) -> None:
    http = served.http
    # demo-encoder has no worker: its request waits in the queue
    rid = http.post("/v1/requests", json={"model": "demo-encoder", "input_ids": [4, 5]}).json()["request_id"]
    assert http.get(f"/v1/requests/{rid}").json()["status"] == "queued"
    resp = http.delete(f"/v1/requests/{rid}")
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "cancelled" and resp.json()["error"]["type"] == "RequestCancelled"
    assert http.get(f"/v1/requests/{rid}").json()["status"] == "cancelled"
    assert http.delete(f"/v1/requests/{rid}").status_code == 200  # cancelling twice is harmless

    done = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [7]}).json()["request_id"]
    _poll_done(http, done)
    conflict = http.delete(f"/v1/requests/{done}")
    assert conflict.status_code == 409 and "succeeded" in conflict.json()["message"]
    assert http.delete("/v1/requests/never-submitted").status_code == 404
    assert http.get("/v1/requests/never-submitted").status_code == 404


def test_models_lists_versions_and_readiness(served: Served) -> None:
    resp = served.http.get("/v1/models")  # OpenAI's list shape, the fleet's fields on each entry
    assert resp.status_code == 200 and resp.json()["object"] == "list"
    models = {m["id"]: m for m in resp.json()["data"]}
    assert models["demo-lm"]["object"] == "model" and models["demo-lm"]["owned_by"] == "onnx-fleet"
    assert models["demo-lm"]["ready"] is True and models["demo-lm"]["served_versions"] == ["1.0.0"]
    assert models["demo-lm"]["version"] == models["demo-encoder"]["version"] == "1.0.0"  # from the cards
    assert models["demo-lm"]["ready_workers"] == 1 and models["demo-lm"]["queue"] == "fleet.demo-lm"
    assert models["demo-encoder"]["ready"] is False and models["demo-encoder"]["ready_workers"] == 0
    assert models["demo-lm"]["max_input_tokens"] == 64


def test_api_keys_are_required_on_v1(served: Served) -> None:
    url = served.gateway.url
    body = {"model": "demo-lm", "input_ids": [1]}
    for headers in ({}, {"X-API-Key": "wrong"}, {"X-API-Key": ""}):
        for method, path in (
            ("POST", "/v1/requests"),
            ("GET", "/v1/models"),
            ("GET", "/v1/requests/x"),
            ("DELETE", "/v1/requests/x"),
            ("POST", "/v1/requests:batch"),
        ):
            resp = httpx.request(method, url + path, headers=headers, json=body if method == "POST" else None)
            assert resp.status_code == 401, (method, path, headers, resp.text)
            error = resp.json()["error"] if path == "/v1/models" else resp.json()  # /v1/models: OpenAI's shape
            assert "X-API-Key" in error["message"]
    for path in ("/healthz", "/readyz", "/metrics", "/docs", "/openapi.json"):
        assert httpx.get(url + path).status_code in (200, 503), path


def test_limits_are_named(served: Served) -> None:
    http = served.http
    big = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [1] * 3000})
    assert big.status_code == 413 and "api.max_body_bytes=4096" in big.json()["message"]
    counted = scrape(served.gateway.url + "/metrics")  # refused before routing, still counted by its route
    key = ("fleet_gateway_requests_total", (("method", "POST"), ("route", "/v1/requests"), ("status", "413")))
    assert counted[key] >= 1
    assert "object has no attribute" not in served.gateway.log_path.read_text()
    broken = http.post("/v1/requests", content=b'{"model": "demo-lm",\n "input_ids": [1, 2,}',
                       headers={"Content-Type": "application/json"})
    assert broken.status_code == 422 and broken.json()["field"] == "body"  # not a character offset
    assert "line 2 column 21" in broken.json()["message"]
    long = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [1] * 65})
    assert long.status_code == 422
    assert long.json()["type"] == "InputTooLong" and "max_input_tokens=64" in long.json()["message"]
    many = http.post("/v1/requests:batch", json={"requests": [{"model": "demo-lm", "input_ids": [1]}] * 17})
    assert many.status_code == 413 and "api.max_batch_requests=16" in many.json()["message"]
    vocab = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [1, 10**9]})
    assert vocab.status_code == 422 and vocab.json()["field"] == "input_ids[1]"
    unknown = http.post("/v1/requests", json={"model": "nope", "input_ids": [1]})
    assert unknown.status_code == 422 and unknown.json()["type"] == "UnknownModel"
    top_k = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [1], "output": {"top_k": 999}})
    assert top_k.status_code == 422 and "max_top_k=64" in top_k.json()["message"]
    odd_id = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [1], "request_id": "user 7/turn 2"})
    assert odd_id.status_code == 422 and odd_id.json()["field"] == "request_id"
    assert odd_id.json()["limit"] == REQUEST_ID_PATTERN  # the rule the client and the CLI refuse it by
    # top_k counts next-token candidates: given for an output that has none, it is refused, not ignored
    for body in ({"model": "demo-encoder", "input_ids": [1], "output": {"top_k": 3}},
                 {"model": "demo-lm", "input_ids": [1], "output": {"top_k": 3, "generation": {}}}):
        pointless = http.post("/v1/requests", json=body)
        assert pointless.status_code == 422 and pointless.json()["field"] == "output.top_k", pointless.json()
        assert "leave top_k out" in pointless.json()["message"]
    shape = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": "abc"})
    assert shape.status_code == 422 and shape.json()["field"] == "input_ids"
    text = http.post("/v1/requests", json={"model": "demo-lm", "text": "a" * 65})
    assert text.status_code == 422 and text.json()["field"] == "text"  # the caller sent text, not input_ids
    assert "max_input_tokens=64" in text.json()["message"]
    for field, value, where in [("temperature", True, "output.generation.temperature"),
                                ("deadline_s", "5", "deadline_s"), ("stop_token_ids", [512], None)]:
        body: dict[str, Any] = {"model": "demo-lm", "input_ids": [1], "output": {"generation": {}}}
        (body["output"]["generation"] if where != "deadline_s" else body)[field] = value
        refused = http.post("/v1/requests", json=body)
        named = where or "output.generation.stop_token_ids[0]"
        assert refused.status_code == 422 and refused.json()["field"] == named, refused.json()


def test_gateway_and_worker_metrics(served: Served) -> None:
    http = served.http
    rid = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [3, 4, 5, 6]}).json()["request_id"]
    _poll_done(http, rid)
    gw = scrape(served.gateway.url + "/metrics")
    key = ("fleet_gateway_requests_total", (("method", "POST"), ("route", "/v1/requests"), ("status", "202")))
    assert gw[key] >= 1
    poll = (
        "fleet_gateway_requests_total",
        (("method", "GET"), ("route", "/v1/requests/{request_id}"), ("status", "200")),
    )
    assert gw[poll] >= 1
    assert gw[("fleet_ready_workers", (("model", "demo-lm"),))] == 1
    assert ("fleet_queue_depth", (("model", "demo-encoder"),)) in gw

    def worker_counted() -> dict[Any, float] | None:
        w = scrape(served.worker_metrics)
        return w if w[("fleet_worker_requests_total", (("model", "demo-lm"), ("outcome", "succeeded")))] else None

    w = wait_until(worker_counted, 10, "the worker's success counter")
    m = (("model", "demo-lm"),)
    assert w[("fleet_worker_batch_size_count", m)] >= 1
    assert w[("fleet_worker_queue_wait_seconds_count", m)] >= 1
    assert w[("fleet_worker_padding_efficiency_count", m)] >= 1
    assert w[("fleet_worker_inference_seconds_count", m)] >= 1
    assert w[("fleet_worker_tokens_total", (("kind", "real"), ("model", "demo-lm")))] >= 4
    assert w[("fleet_worker_ready", m)] == 1

    # every series the shipped Grafana dashboard queries is one these processes export
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "onnx-fleet-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {name for e in exprs for name in re.findall(r"\b(fleet_[a-z_]+)", e)}
    exported = {name for name, _ in [*gw, *w]}
    assert queried and queried <= exported, queried - exported


# -- property-based fuzzing of the OpenAPI document ------------------------------------------------
def _fuzz(run: Any, examples: int) -> None:
    settings(
        max_examples=examples, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )(run)()


def _use_real_model(body: Any) -> None:
    items = body.get("requests") if isinstance(body, dict) else None
    for item in [body, *(items if isinstance(items, list) else [])]:
        if isinstance(item, dict) and "model" in item:
            item["model"] = "demo-lm"


def test_openapi_fuzz_never_5xx_and_worker_survives(served: Served) -> None:
    """Schemathesis cases (valid and invalid) for every operation of the live OpenAPI document."""
    schema = schemathesis.openapi.from_url(served.gateway.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= {
        ("POST", "/v1/requests"),
        ("POST", "/v1/requests:batch"),
        ("GET", "/v1/requests/{request_id}"),
        ("DELETE", "/v1/requests/{request_id}"),
        ("GET", "/v1/models"),
        ("GET", "/readyz"),
    }
    calls = 0
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=op.as_strategy(generation_mode=mode), real_model=st.booleans())
            def run(case: Any, real_model: bool) -> None:
                nonlocal calls
                calls += 1
                if real_model:  # random model names never match: point half the bodies at demo-lm
                    _use_real_model(case.body)
                response = case.call(base_url=served.gateway.url, headers=AUTH)
                if case.path == "/readyz":  # its documented 503: demo-encoder (or a fuzzed model) has no worker
                    assert response.status_code in (200, 503) and "problems" in response.json()
                else:
                    assert response.status_code < 500, (case.method, case.path, case.body, response.text)

            try:
                _fuzz(run, 30)
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # an operation without inputs has no invalid ones
    assert calls >= 100
    unauthorized = httpx.get(served.gateway.url + "/v1/models", headers={"X-API-Key": "fuzz"})
    assert unauthorized.status_code == 401
    _assert_worker_alive_and_serving(served)


@given(
    ids=st.lists(st.integers(min_value=0, max_value=511), max_size=70),
    wild=st.none() | st.integers(min_value=-(2**70), max_value=2**70),
    text=st.none() | st.text(max_size=70),
    top_k=st.integers(min_value=1, max_value=64) | st.integers(min_value=-3, max_value=10**6),
    kind=st.sampled_from([None, None, None, "next_token", "embedding", "bogus"]),
    deadline_s=st.none() | st.floats(allow_nan=False, allow_infinity=False, min_value=-1, max_value=5),
)
def _submit_anything(
    served: Served,
    ids: list[int],
    wild: int | None,
    text: str | None,
    top_k: int,
    kind: str | None,
    deadline_s: float | None,
) -> None:
    if wild is not None:  # one id from anywhere, maybe out of the vocabulary or of int64
        ids = [*ids[: len(ids) // 2], wild, *ids[len(ids) // 2 :]]
    body: dict[str, Any] = {"model": "demo-lm", "output": {"top_k": top_k, "kind": kind}}
    body.update({"text": text} if text is not None else {"input_ids": ids})
    if deadline_s is not None:
        body["deadline_s"] = deadline_s
    resp = served.http.post("/v1/requests", json=body)
    assert resp.status_code in (202, 413, 422), (body, resp.text)


def test_fuzzed_requests_for_a_real_model_never_crash_the_worker(served: Served) -> None:
    """Near-valid requests for demo-lm: each is refused with 4xx or queued, and the worker lives on."""
    _fuzz(lambda: _submit_anything(served), 60)
    _assert_worker_alive_and_serving(served)


def _assert_worker_alive_and_serving(served: Served) -> None:
    assert served.worker.proc is not None and served.worker.proc.poll() is None, "the worker died"
    rid = served.http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [2, 3]}).json()["request_id"]
    assert _poll_done(served.http, rid, 60)["status"] == "succeeded"
