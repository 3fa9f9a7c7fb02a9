"""A body under the byte cap must not cost the gateway more memory than its bytes: a real ``fleet api``
process takes floods of small-but-deep bodies, and its peak RSS (``VmHWM`` in ``/proc/<pid>/status``)
stays under a bound. The key is checked before any body is read, the JSON's shape before it is parsed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from producer.client import FleetClient
from protocol.settings import load_settings
from tests.integration.ops_fixtures import API_KEY, GatewayProcess, OpsFleet, lone_gateway, ops_models, ops_redis
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

CONCURRENCY = 16
PEAK_RSS_BOUND_MB = 300
"""The bound on the gateway's peak RSS under every flood below (it starts near 110 MB)."""
JSON = {"Content-Type": "application/json"}

# Each body is 0.8-1 MB, under the default 1 MiB cap; each expands ~20-80x once parsed into objects.
FLOODS: dict[str, tuple[str, dict[str, Any], str]] = {
    "embeddings": ("/v1/embeddings", {"model": "demo-encoder", "input": [[5]] * 200_000}, "input"),
    "completions": ("/v1/completions", {"model": "demo-lm", "prompt": [[5]] * 200_000}, "prompt"),
    "chat": ("/v1/chat/completions", {"model": "demo-lm", "messages": [{"role": "user"}] * 50_000}, "messages"),
    "batch": ("/v1/requests:batch", {"requests": [{"model": "demo-lm"}] * 50_000}, "requests"),
    "stop strings": (
        "/v1/requests",
        {"model": "demo-lm", "input_ids": [5], "output": {"generation": {"stop": ["ab"] * 180_000}}},
        "output",
    ),
}


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis
) -> Iterator[GatewayProcess]:
    # the shipped defaults: 1 MiB bodies, 256 requests per batch; no worker (nothing here is queued)
    api = {"max_body_bytes": 1_048_576, "max_batch_requests": 256}
    yield from lone_gateway(tmp_path_factory, ops_models, ops_redis, "amplification", api)


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set so far (``VmHWM``), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def flood(url: str, raw: bytes, headers: dict[str, str]) -> list[httpx.Response]:
    """``CONCURRENCY`` simultaneous POSTs of ``raw``."""

    def post(_: int) -> httpx.Response:
        return httpx.post(url, content=raw, headers=headers, timeout=120)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(post, range(CONCURRENCY)))


def test_without_a_key_no_body_is_read(gateway: GatewayProcess) -> None:
    before = peak_rss_mb(gateway.proc.pid)
    statuses = []
    for path, body, _ in FLOODS.values():
        raw = json.dumps(body, separators=(",", ":")).encode()
        assert len(raw) < 1_048_576
        statuses += [r.status_code for r in flood(gateway.url + path, raw, JSON)]
    peak = peak_rss_mb(gateway.proc.pid)
    print(f"peak RSS {before:.0f} MB before, {peak:.0f} MB after {len(statuses)} keyless floods")
    assert peak < PEAK_RSS_BOUND_MB, f"gateway peaked at {peak:.0f} MB (started at {before:.0f} MB)"
    assert set(statuses) == {401}


def test_deep_bodies_are_refused_before_they_are_parsed(gateway: GatewayProcess) -> None:
    before = peak_rss_mb(gateway.proc.pid)
    answers = {}
    for name, (path, body, _) in FLOODS.items():
        raw = json.dumps(body, separators=(",", ":")).encode()
        answers[name] = flood(gateway.url + path, raw, {**JSON, "X-API-Key": API_KEY})
    peak = peak_rss_mb(gateway.proc.pid)
    print(f"peak RSS {before:.0f} MB before, {peak:.0f} MB after the keyed floods")
    assert peak < PEAK_RSS_BOUND_MB, f"gateway peaked at {peak:.0f} MB (started at {before:.0f} MB)"
    for name, responses in answers.items():
        path, _, field = FLOODS[name]
        for response in responses:
            assert response.status_code == 413, (name, response.text[:300])
            doc = response.json()
            error = doc["error"] if path.startswith(("/v1/embeddings", "/v1/c")) else doc
            named = error["param"] if "param" in error else error["field"]
            assert named == field, (name, error)
            assert "api.max_batch_requests=256" in error["message"], error
    # bodies of the legitimate size still pass: 256 inputs, each with its own arrays, strings and keys
    batch = {"requests": [{"model": "demo-lm", "input_ids": [5, 6], "output": {"generation": {"stop": ["a"]}}}] * 256}
    accepted = httpx.post(gateway.url + "/v1/requests:batch", json=batch, headers={"X-API-Key": API_KEY}, timeout=60)
    assert accepted.status_code == 202, accepted.text[:300]
    assert len(accepted.json()["requests"]) == 256


def test_a_body_that_is_not_declared_json_is_refused_naming_content_type(gateway: GatewayProcess) -> None:
    body = json.dumps({"model": "demo-lm", "input_ids": [5]}).encode()
    for path in ("/v1/requests", "/v1/completions"):
        for headers in ({}, {"Content-Type": "text/plain"},  # and forms, which no route reads (they passed on: 422)
                        {"Content-Type": "application/x-www-form-urlencoded"}, {"Content-Type": "multipart/form-data"}):
            resp = httpx.post(gateway.url + path, content=body, headers={**headers, "X-API-Key": API_KEY})
            assert resp.status_code == 415, (path, headers, resp.text)
            doc = resp.json()
            error = doc["error"] if path == "/v1/completions" else doc
            assert (error.get("field") or error.get("param")) == "Content-Type"
            assert "application/json" in error["message"]
            assert "missing" in error["message"] if not headers else headers["Content-Type"] in error["message"]
    ok = httpx.post(gateway.url + "/v1/requests", content=body,
                    headers={"Content-Type": "application/json; charset=utf-8", "X-API-Key": API_KEY})  # fmt: skip
    assert ok.status_code == 202, ok.text


TEXT = "hello world, " * 75_000
"""975,000 characters: 975,000 tokens for demo-lm's byte tokenizer, 450,000 for demo-encoder's WordPiece."""
TEXT_FLOODS = {
    "/v1/requests": ({"model": "demo-lm", "text": TEXT}, "text"),
    "/v1/embeddings": ({"model": "demo-encoder", "input": TEXT}, "input"),
    "/v1/completions": ({"model": "demo-lm", "prompt": TEXT}, "prompt"),
}


def test_long_texts_are_refused_before_they_are_tokenized(gateway: GatewayProcess) -> None:
    before = peak_rss_mb(gateway.proc.pid)
    answers = {}
    for path, (body, _) in TEXT_FLOODS.items():
        raw = json.dumps(body).encode()
        answers[path] = flood(gateway.url + path, raw, {**JSON, "X-API-Key": API_KEY})
    peak = peak_rss_mb(gateway.proc.pid)
    print(f"peak RSS {before:.0f} MB before, {peak:.0f} MB after the text floods")
    assert peak < PEAK_RSS_BOUND_MB, f"gateway peaked at {peak:.0f} MB (started at {before:.0f} MB)"
    for path, responses in answers.items():
        field = TEXT_FLOODS[path][1]
        for response in responses:
            assert response.status_code in (400, 422), (path, response.text[:300])
            doc = response.json()
            error = doc["error"] if path != "/v1/requests" else doc
            assert (error.get("param") or error.get("field")) == field, (path, error)
            assert "max_input_tokens=64" in error["message"], error
    # a text of the allowed size is still tokenized and checked as before
    short = httpx.post(gateway.url + "/v1/requests", json={"model": "demo-lm", "text": "hello " * 20},
                       headers={"X-API-Key": API_KEY})  # fmt: skip
    assert short.status_code == 422 and short.json()["message"].startswith("text has 120 tokens"), short.text
    assert short.json()["field"] == "text"  # named as the caller sent it


@pytest.mark.parametrize("truncate", ["left", "right"])
def test_a_truncated_long_text_keeps_the_tokens_full_tokenization_keeps(
    tmp_path: Path, ops_models: Any, ops_redis: EmbeddedRedis, truncate: str
) -> None:
    """Past the length any 64-token text could have, a text is cut before it is tokenized, on the side
    truncation keeps: the ids that reach the queue are those of tokenizing all of it, then truncating."""
    fleet = OpsFleet(tmp_path, ops_models, ops_redis)
    try:
        limits = {"max_input_tokens": 64, "truncate": truncate}
        config = fleet.config(models={"demo-encoder": {"limits": limits}, "demo-lm": {"limits": limits}})
        client = FleetClient(load_settings(config))
        words = " ".join(f"w{i % 997}x{i}" for i in range(60_000))  # ~0.6 MB of distinct words
        for model in ("demo-encoder", "demo-lm"):
            _, info = client._model(model)
            assert info.tokenizer is not None
            full = info.tokenizer.encode(words)
            kept = full[-64:] if truncate == "left" else full[:64]
            request = client.build_request(model, text=words)
            assert (request.input_ids, request.truncated) == (kept, True), model
        client.close()
    finally:
        fleet.close()
